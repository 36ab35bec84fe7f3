"""The RQ workers that run bulk jobs (`conveyor bulk worker`): they stop promptly, and they
find a dead worker's job soon enough for its retry to resume it.

**Stopping.** RQ's worker listens for commands (shutdown, stop a job) on a pub/sub thread
that waits up to 60 s at a time, and stops it by unsubscribing, then stopping the thread:
the unsubscribe's reply wakes the thread, which then sees the stop. Since redis-py 8.2,
``stop()`` waits for the thread to end, and where the thread reads the reply before the stop
flag is set it goes back to waiting for a subscription, for 60 s: the worker's exit
(SIGTERM, the end of a burst) then hangs for a minute. These workers set the flag first, so
the reply ends the thread, and never wait for it longer than a second (it is a daemon
thread).

**Abandoned jobs.** A job whose worker and work horse died stays ``started`` until some
worker's maintenance finds that its heartbeats stopped; only then does RQ retry it. With
RQ's defaults that takes 90 s of silence, found by a maintenance that runs every 10 minutes
(an idle worker only when its ~7-minute dequeue wait ends): up to ~20 minutes, longer than
any watch should keep the job's requests alive. These workers heartbeat a job every
``JOB_MONITORING_S``, call it abandoned ``ABANDONED_AFTER_S`` after the last heartbeat, and
look every ``MAINTENANCE_S``, idle or busy (RQ looks only between jobs): a dead worker's
job is retried, by any other worker of the queue, within about 30 s
(producer/bulk/defaults.py). The retry goes to the front of the queue.

**Orphaned work horses.** RQ puts a work horse in its own process group, and nothing ends
it when its worker dies: it would run on beside the retry. A BulkWorker's horse asks the
kernel to kill it when its worker dies (Linux's parent-death signal), and a horse that
runs on all the same (another OS, or a worker alive but cut off from Redis) stops at its
journal's next write, which a newer run has fenced off (producer/bulk/journal.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Any

from rq import Queue, SimpleWorker, Worker
from rq.job import Job
from rq.utils import now

from producer.bulk import defaults

# How long a stopping worker waits for its pub/sub thread to end.
PUBSUB_JOIN_S = 1.0
# prctl(2): the signal the calling process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> bool:
    """Have the kernel SIGKILL this process when its parent dies (Linux); exit at once if
    the parent ``parent_pid`` is already gone. False where the platform cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # not Linux
        return False
    if os.getppid() != parent_pid:  # it died before the request took effect
        os._exit(1)
    return True


class _PromptUnsubscribe:
    """Worker.unsubscribe in the order that lets the pub/sub thread end at once."""

    def unsubscribe(self) -> None:
        thread = getattr(self, "pubsub_thread", None)
        pubsub = getattr(self, "pubsub", None)  # made by subscribe() only
        if thread is None or pubsub is None:
            return
        try:
            thread.stop(timeout=0)  # the flag first; no wait here
        except TypeError:  # a redis-py whose stop() takes no timeout, and does not wait
            thread.stop()
        pubsub.unsubscribe()  # its reply wakes the thread, which sees the flag and ends
        thread.join(timeout=PUBSUB_JOIN_S)
        pubsub.close()


class _FrequentMaintenance:
    """Look for abandoned jobs every ``maintenance_interval`` seconds, also while idle."""

    def __init__(self, *args: Any, maintenance_interval: int = defaults.MAINTENANCE_S,
                 **kwargs: Any) -> None:
        super().__init__(*args, maintenance_interval=maintenance_interval, **kwargs)

    @property
    def dequeue_timeout(self) -> int:
        # An idle worker runs its maintenance when its blocking dequeue times out.
        return max(1, min(super().dequeue_timeout, int(self.maintenance_interval)))


class BulkWorker(_PromptUnsubscribe, _FrequentMaintenance, Worker):
    """RQ's forking worker (each job in a work horse), stopping promptly, and keeping its
    job's heartbeat short so that another worker retries it soon after both die."""

    def __init__(self, *args: Any, job_monitoring_interval: int = defaults.JOB_MONITORING_S,
                 **kwargs: Any) -> None:
        super().__init__(*args, job_monitoring_interval=job_monitoring_interval, **kwargs)

    def fork_work_horse(self, job: Job, queue: Queue) -> None:
        self._parent_pid = os.getpid()  # read by the horse, after the fork
        super().fork_work_horse(job, queue)

    def main_work_horse(self, job: Job, queue: Queue) -> None:
        die_with_parent(self._parent_pid)
        super().main_work_horse(job, queue)

    def maintain_heartbeats(self, job: Job, execution: Any) -> None:
        super().maintain_heartbeats(job, execution)
        # RQ looks for abandoned jobs only between jobs: a busy worker looks here too. A
        # failed look must not end the watch over this worker's own horse.
        if self.should_run_maintenance_tasks:
            try:
                self.run_maintenance_tasks()
            except Exception:  # noqa: BLE001 - logged; the next look tries again
                self.log.exception("Worker %s: maintenance failed", self.name)
                self.last_cleaned_at = now()

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """How long the job counts as alive after a heartbeat: until the next heartbeat is
        due, plus ABANDONED_AFTER_S (RQ adds 60 s)."""
        interval = float(self.job_monitoring_interval)
        if job.timeout and job.timeout > 0:
            interval = max(0.0, min(job.timeout - working_time, interval))
        return int(interval) + defaults.ABANDONED_AFTER_S


class BulkSimpleWorker(_PromptUnsubscribe, _FrequentMaintenance, SimpleWorker):
    """RQ's worker that runs jobs in its own process (tests, embedding), stopping promptly.
    It cannot heartbeat a job while it runs it, so its jobs keep RQ's heartbeat TTL."""
