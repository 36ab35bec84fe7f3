"""Running a workload (``workloads``, ``arrivals``) on each system compared: the offline
engine, the fleet (worker processes, followers), transformers' static batches."""
