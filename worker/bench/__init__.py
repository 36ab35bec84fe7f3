"""Benchmarks: the reference workloads and `conveyor bench`."""
