"""Moving KV between workers: the prefill → decode handoff and fleet-wide prefix sharing.

Stages: a *prefill* worker computes a prompt, publishes the first token, writes the KV to
the tier and hands the request on (``handoff``); a *decode* worker takes the handoff
entry like any request and resumes at token k with the KV read from the tier instead of
computed. ``prefix_share`` puts full prompt blocks in the tier by chain hash and reads
them back for any worker's request that shares the prefix. A missing or corrupt transfer
is recomputed, never an error.
"""
