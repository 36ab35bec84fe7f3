"""Bulk work over the fleet: RQ jobs (``producer.bulk.analyze_document``) and batch files.

Everything here uses RQ's JSON serializer; nothing is pickled.
"""

from producer.bulk.analyze import AnalysisFailed, analyze_document
from producer.bulk.batch_file import BatchSummary, run_batch_file
from producer.bulk.queue import (
    ANALYZE_FUNC,
    bulk_queue,
    enqueue_analyze,
    fetch_job,
    job_progress,
    job_timeout_for,
)

__all__ = [
    "ANALYZE_FUNC",
    "AnalysisFailed",
    "BatchSummary",
    "analyze_document",
    "bulk_queue",
    "enqueue_analyze",
    "fetch_job",
    "job_progress",
    "job_timeout_for",
    "run_batch_file",
]
