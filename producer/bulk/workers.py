"""The RQ workers that run bulk jobs (`conveyor bulk worker`), stopping promptly.

RQ's worker listens for commands (shutdown, stop a job) on a pub/sub thread that waits up
to 60 s at a time, and stops it by unsubscribing, then stopping the thread: the unsubscribe's
reply wakes the thread, which then sees the stop. Since redis-py 8.2, ``stop()`` waits for
the thread to end, and where the thread reads the reply before the stop flag is set it goes
back to waiting for a subscription, for 60 s: the worker's exit (SIGTERM, the end of a
burst) then hangs for a minute. These workers set the flag first, so the reply ends the
thread, and never wait for it longer than a second (it is a daemon thread).
"""

from __future__ import annotations

from rq import SimpleWorker, Worker

# How long a stopping worker waits for its pub/sub thread to end.
PUBSUB_JOIN_S = 1.0


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


class BulkWorker(_PromptUnsubscribe, Worker):
    """RQ's forking worker (each job in a work horse), stopping promptly."""


class BulkSimpleWorker(_PromptUnsubscribe, SimpleWorker):
    """RQ's worker that runs jobs in its own process (tests, embedding), stopping promptly."""
