"""Every Redis key, key pattern and channel name conveyor uses comes from here.

No other module formats a ``{ns}:`` key (tests/test_one_place.py checks the source): the
ACL rules (producer/redis/acl.py) and the fleet KV tier (kvstore/tier/redis_tier.py) take
theirs from :class:`Keys` too. Names Redis hands back are read with ``as_text``.
"""

from __future__ import annotations

import re

from producer.wire.validation import brief, validate_choice_id, validate_request_id


def as_text(value: object) -> str:
    """A Redis reply as text: ids, names and values come back as bytes from clients that do
    not decode responses (the project's never do); ``value`` decoded when it is bytes, else
    its str()."""
    return value.decode() if isinstance(value, bytes) else str(value)

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

    def affinity_lane(self, model: str, worker_id: str, lane: str) -> str:
        """A worker's affinity lane of one model and lane (``conveyor:req:{tiny}:@w1:
        interactive``): requests whose prompt prefix that worker holds, read by it first and
        by any other worker once they waited past the affinity delay, or at once when the
        worker is gone or draining (docs/affinity.md). Under the
        model's hash tag and ``{ns}:req:*`` like the shared lanes: one XREADGROUP reads
        both, and producers may add to it as to them."""
        return (f"{self.ns}:req:{{{validate_name('model', model)}}}:"
                f"@{validate_name('worker id', worker_id)}:{validate_lane(lane)}")

    def affinity_lanes_of(self, model: str, worker_id: str) -> tuple[str, ...]:
        """Worker ``worker_id``'s affinity lanes of ``model``, one a lane (LANES' order)."""
        return tuple(self.affinity_lane(model, worker_id, lane) for lane in LANES)

    def affinity_lane_pattern(self, model: str) -> str:
        """Glob of every worker's affinity lanes of ``model``."""
        return f"{self.ns}:req:{{{validate_name('model', model)}}}:@*"

    def affinity_owners(self, model: str, generation: int) -> str:
        """Hash of prefix key (16 hex digits: producer/affinity/prefix_keys.py) -> the
        worker that holds that prompt prefix in its cache, for one generation of the owners
        (``producer.affinity.routing.generation``: a span of the clock). A worker writes a
        key into the generation of now and the next one; producers read now's; each hash
        expires a generation after its own ends."""
        if not isinstance(generation, int) or generation < 0:
            raise ValueError(f"a generation is an int >= 0, got {generation!r}")
        return f"{self.ns}:affinity:{{{validate_name('model', model)}}}:owners:{generation}"

    def affinity_lane_worker(self, stream: str) -> str | None:
        """The worker whose affinity lane ``stream`` is (:meth:`affinity_lane`); None for a
        shared lane or any other stream."""
        head, _, rest = stream.partition("}:@")
        if not rest or not head.startswith(f"{self.ns}:req:{{"):
            return None
        worker = rest.rpartition(":")[0]
        return worker or None

    def affinity_lanes(self, model: str) -> str:
        """Set of the worker ids that have affinity lanes of ``model`` (dead ones too, until
        their lanes are empty): where workers look for requests to take over."""
        return f"{self.ns}:affinity:{{{validate_name('model', model)}}}:lanes"

    def affinity_owned(self, model: str) -> str:
        """Hash of worker id -> how many prefixes that worker became the owner of: a worker
        that owns more than a peer with room leaves new prefixes to it."""
        return f"{self.ns}:affinity:{{{validate_name('model', model)}}}:owned"

    def old_layout_requests(self, model: str, lane: str) -> str:
        """Where requests went before key layout 2 (``conveyor:req:tiny:interactive``, no hash
        tag). No worker reads it: housekeeping answers what it finds there with an error
        naming :meth:`requests` (docs/protocol.md, "Changelog")."""
        return f"{self.ns}:req:{validate_name('model', model)}:{validate_lane(lane)}"

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
        """Stream of one request's output chunks, then its final entry; choice i > 0 of a
        request with n choices has its own, under its choice id ``{id}.{i}``."""
        return f"{self.ns}:out:{validate_choice_id(request_id)}"

    @property
    def dead(self) -> str:
        """Stream of requests that could not be served, with the reason."""
        return f"{self.ns}:dead"

    def worker(self, worker_id: str) -> str:
        """Hash with a worker's status and load; expires unless its heartbeat renews it."""
        return f"{self.ns}:worker:{validate_name('worker id', worker_id)}"

    @property
    def worker_pattern(self) -> str:
        """Glob of every worker's heartbeat hash."""
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

    def watch(self, watch_id: str) -> str:
        """A producer's watch key, kept alive while the producer lives; requests marked with
        it are cancelled once it lapses (producer/client/watch.py)."""
        return f"{self.ns}:watch:{validate_request_id(watch_id)}"

    # ----- the fleet KV tier (kvstore/tier/redis_tier.py) -----

    def kv_header(self, name: str) -> str:
        """Header of the run of KV blocks named ``name``; hash-tagged on the name, so the
        header and its chunks share one Redis Cluster slot."""
        return f"{self.ns}:kv:{{{name}}}:h"

    def kv_chunk(self, name: str, index: int) -> str:
        """Chunk ``index`` of the bytes of the run of KV blocks named ``name``."""
        return f"{self.ns}:kv:{{{name}}}:c{index}"

    def kv_bytes(self, bucket: int) -> str:
        """Counter of the bytes the KV tier stored in one time bucket."""
        return f"{self.ns}:kv:bytes:{bucket}"

    # ----- globs of key families, for ACL rules (producer/redis/acl.py) -----

    @property
    def requests_pattern(self) -> str:
        """Every request lane, old layout included (``{ns}:req:*``)."""
        return f"{self.ns}:req:*"

    @property
    def affinity_pattern(self) -> str:
        """Every affinity owner key and lanes set."""
        return f"{self.ns}:affinity:*"

    @property
    def handoff_pattern(self) -> str:
        """Every handoff stream."""
        return f"{self.ns}:handoff:*"

    @property
    def output_pattern(self) -> str:
        """Every request's output stream."""
        return f"{self.ns}:out:*"

    @property
    def cancelled_pattern(self) -> str:
        """Every cancellation marker."""
        return f"{self.ns}:cancelled:*"

    @property
    def watch_pattern(self) -> str:
        """Every producer's watch key."""
        return f"{self.ns}:watch:*"

    @property
    def model_pattern(self) -> str:
        """Every registered model's hash."""
        return f"{self.ns}:model:*"

    @property
    def isolated_pattern(self) -> str:
        """Every poison-isolation counter."""
        return f"{self.ns}:isolated:*"

    @property
    def kv_pattern(self) -> str:
        """Every key of the fleet KV tier."""
        return f"{self.ns}:kv:*"
