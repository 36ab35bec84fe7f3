"""The host under the engine: CPU kernels (C++ in ``csrc/``, built once per machine by
``cpu_kernels``, in the background while engines serve on torch: ``kernel_build``), OpenMP
and thread placement, the allocator, threads that must not take a core from the engine's,
the device and dtype an engine runs on (``device``) and a step's inputs moved to it in one
copy (``step_upload``). Nothing here knows about requests.
"""
