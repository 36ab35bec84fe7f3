"""Housekeeping of a fleet worker, off the data path: renew the leases of in-flight
entries, reclaim those of dead workers (``reaper``), announce this worker (``heartbeat``,
``registration``) and prune stale consumers."""
