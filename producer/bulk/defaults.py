"""Defaults of bulk work (RQ jobs and batch files), each with its meaning."""

from __future__ import annotations

# --- RQ ----------------------------------------------------------------------------------------

# The RQ queue bulk jobs go on unless the caller names another.
DEFAULT_QUEUE = "conveyor-bulk"

# An analyze job may run this long however short its document (seconds) ...
JOB_TIMEOUT_BASE_S = 600
# ... plus this much per 1,000 characters of document (about 250 tokens of prefill and one
# chunk answer's share of decode on a busy fleet).
JOB_TIMEOUT_PER_1K_CHARS_S = 6.0
# Finished jobs keep their result (and failed ones their traceback) this long (seconds).
RESULT_TTL_S = 7 * 24 * 3600
FAILURE_TTL_S = 7 * 24 * 3600
# Times RQ runs an analysis job again after its worker died (or Redis failed it); each
# run resumes from the job's journal. Failures another run cannot mend are never retried.
JOB_RETRIES = 3

# --- Surviving the RQ worker (producer/bulk/journal.py, producer/bulk/workers.py) --------------

# A `conveyor bulk worker` heartbeats its running job this often (seconds; RQ's default 30) ...
JOB_MONITORING_S = 5
# ... a job whose heartbeats stopped (worker and work horse dead) is abandoned this long
# after the last one (RQ's own: 60 s) ...
ABANDONED_AFTER_S = 15
# ... and workers look for abandoned jobs this often, idle or busy (RQ's default: every
# 10 minutes, and an idle worker looks only when its ~7-minute dequeue wait ends).
MAINTENANCE_S = 10
# So a dead worker's job is retried within about 5 + 15 + 10 = 30 s. Its requests must
# outlive that: the job's watch lapses this long after its last renewal (seconds).
WATCH_TTL_S = 90
# A job's journal lives this long after its last write (a failed job can be requeued by
# hand and still resume), and this long once the job returned its result (seconds).
JOURNAL_TTL_S = FAILURE_TTL_S
JOURNAL_KEEP_DONE_S = 3600

# --- Document analysis -------------------------------------------------------------------------

# Document tokens per chunk, and how many of them repeat the end of the previous chunk.
CHUNK_TOKENS = 1500
OVERLAP_TOKENS = 100
# Most tokens each chunk answer (and each reduce answer) may have.
MAX_TOKENS = 256
# What the reduce requests are asked when the caller gives no reduce instruction.
REDUCE_INSTRUCTION = (
    "Below are answers to the same question about consecutive parts of one document. "
    "Combine them into one answer for the whole document."
)

# --- Waiting for the model ---------------------------------------------------------------------

# Seconds an analyze job waits for its model to be registered and served by a live worker
# before it fails (a fleet that is still starting, or scaled to zero); job timeouts add it.
MODEL_WAIT_S = 300.0
# Seconds between two looks at the model's registration and heartbeats while waiting.
MODEL_POLL_S = 1.0

# --- Requests to the fleet ---------------------------------------------------------------------

# Seconds one request may take, queue wait included, before it is presumed lost (its worker
# died) and resubmitted under a new id.
REQUEST_TIMEOUT_S = 600.0
# Tries per request (the first one included) when failures are transient.
MAX_ATTEMPTS = 4
# Backoff before try n+1: a random fraction (half to all) of BASE * 2**(n-1), at most CAP.
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 30.0
# Requests a job (or a batch file run) keeps in flight at once; the rest wait their turn.
CONCURRENCY = 64
# An analysis whose reduce prompt leaves each answer fewer tokens than this (and fewer than
# max_tokens) is refused before its map: its answers would be reduced as fragments.
MIN_REDUCE_ANSWER_TOKENS = 128
