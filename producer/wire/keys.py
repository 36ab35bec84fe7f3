"""Every Redis key and channel name conveyor uses comes from here."""

from __future__ import annotations

import re

from producer.wire.validation import brief, validate_request_id

# The consumer group every worker of a model reads its request streams with.
GROUP = "workers"
# Request lanes, in the order workers read them: interactive work first.
LANES = ("interactive", "batch")

_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def validate_name(kind: str, value: object) -> str:
    """Namespaces, model and worker names become parts of keys: no separators, no spaces."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{kind} must match [A-Za-z0-9._-]{{1,128}}, got {brief(value)}")
    return value


def validate_lane(lane: object) -> str:
    if not isinstance(lane, str) or lane not in LANES:
        raise ValueError(f"lane must be one of {', '.join(LANES)}, got {brief(lane)}")
    return str(lane)


class Keys:
    """Key names under one namespace (default ``conveyor``)."""

    def __init__(self, namespace: str = "conveyor") -> None:
        self.ns = validate_name("namespace", namespace)

    def requests(self, model: str, lane: str) -> str:
        """Stream of requests for one model and lane (consumer group ``workers``).

        The model name is a hash tag (``conveyor:req:{tiny}:interactive``): a model's lanes
        share one Redis Cluster slot, so a worker reads both in one XREADGROUP.
        """
        return f"{self.ns}:req:{{{validate_name('model', model)}}}:{validate_lane(lane)}"

    def handoff(self, model: str, lane: str) -> str:
        """Stream of requests of one lane a prefill worker computed the prompt of, for a
        decode worker to continue (consumer group ``workers``; the KV is in the fleet tier
        under the request id). Hash-tagged like the lanes: its slot is theirs, so handing a
        request on and acknowledging its lane entry is one atomic step."""
        return (f"{self.ns}:handoff:{{{validate_name('model', model)}}}:"
                f"{validate_lane(lane)}")

    def lane_of(self, stream: str) -> str:
        """The lane a request or handoff stream of this namespace belongs to."""
        return validate_lane(stream.rsplit(":", 1)[-1])

    def output(self, request_id: str) -> str:
        """Stream of one request's output chunks, then its final entry."""
        return f"{self.ns}:out:{validate_request_id(request_id)}"

    @property
    def dead(self) -> str:
        """Stream of requests that could not be served, with the reason."""
        return f"{self.ns}:dead"

    def worker(self, worker_id: str) -> str:
        """Hash with a worker's status and load; expires unless its heartbeat renews it."""
        return f"{self.ns}:worker:{validate_name('worker id', worker_id)}"

    @property
    def worker_pattern(self) -> str:
        return f"{self.ns}:worker:*"

    @property
    def workers(self) -> str:
        """Set of worker ids that wrote a heartbeat: readers list workers without SCAN
        (members whose hash expired are skipped, and removed by workers' reapers)."""
        return f"{self.ns}:workers"

    @property
    def models(self) -> str:
        """Set of registered model names (each has a ``model`` hash)."""
        return f"{self.ns}:models"

    @property
    def requested(self) -> str:
        """Set of model names requests were submitted for without a registration check
        (``allow_unregistered``): `conveyor top` shows their lanes too."""
        return f"{self.ns}:requested"

    def model(self, name: str) -> str:
        """Hash describing a served model (max length, eos, tokenizer.json)."""
        return f"{self.ns}:model:{validate_name('model', name)}"

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel on which cancellations are announced."""
        return f"{self.ns}:cancel"

    def isolated(self, request_id: str) -> str:
        """Counter of the times a suspect request was served alone (poison isolation)."""
        return f"{self.ns}:isolated:{validate_request_id(request_id)}"

    def cancelled(self, request_id: str) -> str:
        """Marker key of a cancelled request, for workers that missed the announcement."""
        return f"{self.ns}:cancelled:{validate_request_id(request_id)}"
