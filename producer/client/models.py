"""Which models the fleet serves: registrations (``{ns}:model:{name}``) and liveness.

A worker registers its model (a hash that stays after the worker is gone) and writes a
heartbeat hash, ``{ns}:worker:{id}`` with fields ``model`` and ``status``, that expires
three heartbeats after the worker stops renewing it. A model therefore is in one of three
states (docs/reliability.md, "Model states"):

- ``not_registered``: no model hash and no live worker names it;
- ``no_live_worker``: registered, but no heartbeat of a worker serving it says ``serving``
  (or ``degraded``: a worker retrying Redis still serves);
- ``live``: at least one such worker; with worker roles, a ``both`` worker, or a
  ``prefill`` and a ``decode`` worker together (either alone serves no request).

The I/O-free parts live here; :class:`producer.client.client.Client` and ``conveyor top`` read
the hashes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from producer.wire.keys import Keys, as_text, validate_name

# Heartbeat statuses of a worker that takes requests; `starting`, `draining`, `failed` and
# `stopped` workers read no new ones.
LIVE_STATUSES = frozenset({"serving", "degraded"})

NOT_REGISTERED = "not_registered"
NO_LIVE_WORKER = "no_live_worker"
LIVE = "live"


@dataclass(frozen=True)
class ModelState:
    """One model's registration and the live workers serving it.

    ``liveness_known`` is False when the heartbeats could not be read (a producer whose
    ACL does not grant ``{ns}:worker:*``): then ``live_workers`` is empty but means nothing.
    """

    name: str
    registered: bool
    live_workers: tuple[str, ...] = ()
    liveness_known: bool = True
    # Of the live workers, those that read an affinity lane of their own (prefix affinity:
    # producer/affinity/); a request goes to no other's lane.
    affinity_workers: tuple[str, ...] = ()
    # The generation of the owners' hashes those workers write (the one most of their
    # heartbeats name, the latest of a tie: producers read the workers' clocks, not their
    # own); None: none said one.
    affinity_generation: int | None = None

    @property
    def live(self) -> bool:
        """Whether a worker that takes requests for this model is alive (or, when liveness
        cannot be read, whether the model is registered at all)."""
        return bool(self.live_workers) or (not self.liveness_known and self.registered)

    @property
    def known(self) -> bool:
        """Registered, or served by a live worker (whose registration someone removed)."""
        return self.registered or bool(self.live_workers)

    @property
    def state(self) -> str:
        """``live``, ``no_live_worker`` or ``not_registered``."""
        if self.live:
            return LIVE
        return NO_LIVE_WORKER if self.registered else NOT_REGISTERED


def is_live(heartbeat: Mapping[str, str]) -> bool:
    """Whether a worker's heartbeat hash (decoded) says it takes requests."""
    return heartbeat.get("status") in LIVE_STATUSES


def decode_hash(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    return {as_text(k): as_text(v) for k, v in raw.items()}


def model_states(
    registered: Iterable[str],
    heartbeats: Iterable[Mapping[str, str]] | None,
    also: Iterable[str] = (),
) -> list[ModelState]:
    """The state of every registered model, every model a live worker serves and every name
    in ``also``, sorted by name. ``heartbeats`` None: they could not be read."""
    registered = set(registered)
    live: dict[str, list[str]] = {}
    roles: dict[str, set[str]] = {}
    affine: dict[str, list[str]] = {}
    generations: dict[str, list[int]] = {}
    for hb in heartbeats or []:
        if is_live(hb) and hb.get("model"):
            live.setdefault(hb["model"], []).append(hb.get("worker_id", "?"))
            roles.setdefault(hb["model"], set()).add(hb.get("role") or "both")
            if hb.get("affinity") == "1":
                affine.setdefault(hb["model"], []).append(hb.get("worker_id", "?"))
                gen = hb.get("affinity_generation", "")
                if gen.isdigit():
                    generations.setdefault(hb["model"], []).append(int(gen))
    # A request needs its prompt computed and its tokens generated: prefill workers alone
    # hand requests on to nobody, decode workers alone never read the request lanes.
    for model, present in roles.items():
        if "both" not in present and not {"prefill", "decode"} <= present:
            live.pop(model)
    names = registered | set(live) | set(also) | set(roles)
    return [ModelState(name, name in registered, tuple(sorted(live.get(name, []))),
                       heartbeats is not None, tuple(sorted(affine.get(name, []))),
                       _most_named(generations.get(name, [])))
            for name in sorted(names)]


def _most_named(generations: list[int]) -> int | None:
    """The generation most workers name (the latest of a tie): one worker whose clock runs
    a generation ahead does not send every producer to a hash only it writes."""
    if not generations:
        return None
    return max(set(generations), key=lambda g: (generations.count(g), g))


def state_of(name: str, registered: bool,
             heartbeats: Iterable[Mapping[str, str]] | None) -> ModelState:
    """One model's state from its registration and every worker's heartbeat."""
    [state] = [s for s in model_states([name] if registered else [], heartbeats, also=[name])
               if s.name == name]
    return state


def member_names(members: Iterable[bytes | str]) -> list[str]:
    """Sorted names from a set (``{ns}:models``, ``{ns}:workers``), skipping any that is not
    a valid name (the set's writers are trusted, its readers check anyway)."""
    names = set()
    for member in members:
        try:
            names.add(validate_name("name", as_text(member)))
        except (ValueError, UnicodeDecodeError):
            continue
    return sorted(names)


def heartbeat_keys(keys: Keys, members: Iterable[bytes | str]) -> list[str]:
    """The heartbeat hash of each worker id in the ``{ns}:workers`` set."""
    return [keys.worker(wid) for wid in member_names(members)]


def pick_default_model(states: list[ModelState]) -> str | None:
    """The model a command uses when none is named: the only one with a live worker, else
    the only registered one; None when there is none or the choice is ambiguous.

    A registration left by a worker long gone no longer hides the model that is served.
    """
    live = [s.name for s in states if s.live]
    if live:
        return live[0] if len(live) == 1 else None
    registered = [s.name for s in states if s.registered]
    return registered[0] if len(registered) == 1 else None


def describe_choice(states: list[ModelState], namespace: str) -> str:
    """Why :func:`pick_default_model` found nothing, for an error message."""
    live = [s.name for s in states if s.live]
    registered = [s.name for s in states if s.registered]
    if len(live) > 1:
        return f"several models have a live worker ({', '.join(live)}): pass --model"
    if not registered:
        return (f"no model is registered in namespace {namespace!r}: "
                "start a worker or pass --model")
    return (f"several models are registered ({', '.join(registered)}) and none has a live "
            "worker: pass --model")

