"""Stage 3 of a fleet worker: publishing. Detokenize each step's tokens (``text_stage``),
coalesce them per stream (``chunk_holder``), and write them with one pipeline a batch
(``publisher``, ``raw_pipeline``), fenced so a worker presumed dead cannot write
(``ownership``); a request is acknowledged only after its final entry."""
