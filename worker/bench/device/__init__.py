"""Benchmarks of the engine on a GPU against the device's own limits (issue 46)."""
