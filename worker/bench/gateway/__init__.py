"""Benchmarks of `conveyor gateway` with real processes: many streams at once
(``streams``), slow clients against its timeouts (``slow_clients``)."""
