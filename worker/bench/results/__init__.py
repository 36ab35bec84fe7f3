"""What a benchmark run measured: per-request records, latency and goodput metrics, the
machine's limits measured beside them, the report and the plots."""
