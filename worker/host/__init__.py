"""The host under the engine: CPU kernels (C++ in ``csrc/``, built once per machine by
``cpu_kernels``, in the background while engines serve on torch: ``kernel_build``), OpenMP
and thread placement, the allocator, and threads that must not take a core from the
engine's. Nothing here knows about requests.
"""
