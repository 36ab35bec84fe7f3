"""Prefix affinity, the worker's half: its own affinity lanes (read with the shared ones),
the prefixes it advertises, and taking requests from other workers' lanes when they wait
too long or their worker is gone (docs/affinity.md)."""
