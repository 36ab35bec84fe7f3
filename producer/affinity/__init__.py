"""Prefix affinity, the producer's half: which keys a prompt's prefixes have, and which
worker's affinity lane a request goes to (docs/affinity.md).

No I/O here: the clients read the owners (one HMGET) and write the request.
"""
