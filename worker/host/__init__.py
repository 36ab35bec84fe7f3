"""The host under the engine: CPU kernels (C++ in ``csrc/``, built once per machine by
``cpu_kernels``), OpenMP and thread placement, the allocator, and threads that must not
take a core from the engine's. Nothing here knows about requests.
"""
