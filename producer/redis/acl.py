"""Redis ACL rules that limit a producer, a worker and an observer to their keys and commands.

Two sets of rules. On Redis >= 7 (the default) selectors give each key pattern its own
commands: a producer can add requests but not read them back, read output streams but
not write them, and run conveyor's functions but no Lua of its own; the observer reads
counts only. Redis 6.2 has neither selectors nor functions, so its rules (``version=6``)
are one key list shared by all of a user's commands (docs/security.md, "Redis 6.2").

docs/security.md shows them for the default namespace; tests apply them to a real server,
run each attack they forbid, and run a request through, so the rules stay what the code
actually sends.
"""

from __future__ import annotations

from producer.wire.keys import Keys

ROLES = ("producer", "worker", "observer")
VERSIONS = (7, 6)


def _producer_selectors(k: Keys) -> list[tuple[list[str], list[str]]]:
    """(key patterns, commands) of each producer selector on Redis 7, with why."""
    return [
        # Submit: XADD to a lane, or FCALL conveyor_add_if_room for max_queue, which
        # counts the lane and its handoff stream (EXISTS, XINFO GROUPS, XLEN) and XADDs to
        # the lane as this user. Lane depths: XLEN, XINFO GROUPS. No XRANGE/XREAD/XINFO
        # STREAM: other producers' prompts stay unread; no XADD to a handoff stream.
        ([f"~{k.requests_pattern}"], ["xadd"]),
        ([f"~{k.requests_pattern}", f"~{k.handoff_pattern}"],
         ["fcall", "exists", "xinfo|groups", "xlen"]),
        # Whether its own request is still held (producer/client/orphans.py): who holds
        # its entry (XPENDING names consumers, never content).
        ([f"%R~{k.requests_pattern}"], ["xpending"]),
        # Stream, result, follow_many; XREVRANGE for the last entry when resuming; EXISTS
        # when a wait looks for its request. Read only: a producer cannot forge another
        # request's tokens or final.
        ([f"%R~{k.output_pattern}"], ["xread", "xrevrange", "exists"]),
        # Cancel: the marker (write only), with its announcement (PUBLISH, below). The
        # producer's watch key (SET with EX, renewed), which workers read.
        ([f"%W~{k.cancelled_pattern}", f"%W~{k.watch_pattern}"], ["set"]),
        # Models and their tokenizers, live workers: sets and hashes, never SCAN.
        ([f"%R~{p}" for p in _fleet(k)], ["hget", "hgetall", "smembers", "exists"]),
        # A request for a model nobody registered (allow_unregistered): noted for `top`.
        ([f"%W~{k.requested}"], ["sadd"]),
        # Prefix affinity: which worker holds a prompt's prefix, which workers have lanes
        # (read only: a producer cannot name itself the owner of anything).
        ([f"%R~{k.affinity_pattern}"], ["hmget", "smembers"]),
    ]


def _observer_selectors(k: Keys) -> list[tuple[list[str], list[str]]]:
    """(key patterns, commands) of each observer (`conveyor top`) selector on Redis 7."""
    return [
        # Counts only, never an entry: of the lanes and of the handoff streams.
        ([f"~{k.requests_pattern}", f"~{k.handoff_pattern}"], ["xlen", "xinfo|groups"]),
        ([f"%R~{p}" for p in (*_fleet(k), k.requested)], ["hgetall", "smembers"]),
        # The workers with affinity lanes: their depths count in their lane's.
        ([f"%R~{k.affinity_pattern}"], ["smembers"]),
    ]


def _fleet(k: Keys) -> list[str]:
    """The models and the live workers: what every role reads."""
    return [k.model_pattern, k.models, k.worker_pattern, k.workers]


# Commands a producer sends on Redis 6.2 (one key list for all), and why.
PRODUCER_COMMANDS_6 = (
    "ping",  # health check of an idle connection
    "xadd",  # submit
    "evalsha", "eval", "script|load",  # submit(max_queue=...): no functions on 6.2
    "exists", "xinfo", "xlen", "xrange",  # run by that script; lane depths (producer.client.queues)
    "xpending",  # whether a request it waits for is still held (producer.client.orphans)
    "xread",  # stream, result, follow_many
    "xrevrange",  # a stream's last entry: resuming after its end, `conveyor tail`
    "set", "publish", "multi", "exec", "discard",  # cancel: marker and announcement at once
    "hget", "hgetall", "smembers",  # models, model_info, tokenizer; live workers (heartbeats)
    "sadd",  # a request for an unregistered model, noted for `conveyor top`
    "hmget",  # prefix affinity: the owners of a prompt's prefixes
)

# Commands a worker (worker/fleet) sends, and why. Workers are trusted with their
# namespace: they read requests, write outputs and run their own scripts.
WORKER_COMMANDS = (
    "ping",  # health checks, also on the subscribed connection
    "info",  # at start: refuse a Redis whose maxmemory-policy may evict request streams
    "client|setname",  # each thread names its connection ({worker_id}:{thread}) for CLIENT LIST
    "xgroup|create",  # the consumer group, recreated if a Redis restart lost it
    "xgroup|delconsumer",  # dead workers' consumers, once they hold no pending entry
    "xreadgroup", "xack",  # intake; acknowledged after the final entry
    "xpending", "xclaim", "xautoclaim",  # leases, reaping dead workers' entries, delivery counts
    "xadd", "expire", "xrange", "xrevrange",  # output streams, dead letters, resumption
    "xsetid", "xdel",  # taking a claimed request's output stream over (intake/resume.py)
    "exists",  # cancellation markers; dead workers' heartbeats; producers' watch keys
    "get", "incr",  # runs alone of a suspect request (poison isolation)
    "subscribe", "unsubscribe",  # the cancel channel
    "hset", "hdel", "del",  # heartbeat hash (removed at exit), the model hash (and its template)
    "hgetall",  # at start: the other workers' heartbeats (no real and simulated on one model)
    "sadd", "srem", "smembers",  # the models and workers sets (dead workers pruned)
    "evalsha", "eval", "script|load",  # lease renewal (reloaded on restart), take-overs
    "xinfo", "xlen", "xtrim", "multi", "exec", "discard",  # lane depths, trimming served requests
    "set", "mget", "incrby", "decrby", "pexpire",  # the fleet KV tier ({ns}:kv:*)
    # prefix affinity: the owners' hashes (HSET, EXPIRE), the lanes set (SADD, SMEMBERS),
    # owned counts (HGETALL, HSET, HINCRBY),
    # heartbeats of the workers with lanes (HMGET), TIME in the take-over script
    "hmget", "time", "hincrby",
)
# Redis 7 only (6.2 refuses a rule naming a command it lacks): compare the server's
# conveyor library with the worker's own. Not FUNCTION LOAD: functions are server-wide, and
# a tenant that could load them could replace the code every other tenant's producers run.
WORKER_COMMANDS_7 = ("function|list",)

# Commands `conveyor top` (worker.cli.top) sends on Redis 6.2: read-only.
OBSERVER_COMMANDS_6 = (
    "ping",
    "smembers", "hgetall",  # workers, models and their hashes
    "xinfo", "xlen", "xrange",  # lane depths (no consumer-group lag on 6.2: XRANGE counts)
)


def _check(role: str, version: int) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if version not in VERSIONS:
        raise ValueError(f"version must be 7 (Redis >= 7) or 6 (Redis 6.2), got {version!r}")


def key_patterns(role: str, namespace: str = "conveyor") -> list[str]:
    """Glob patterns of the keys ``role`` may touch, whatever the command (Redis 6.2 rules)."""
    _check(role, 6)
    k = Keys(namespace)
    if role == "producer":
        # The handoff streams: submit(max_queue=...) counts them (their XADD stays open
        # on 6.2, where one key list serves every command).
        return [k.requests_pattern, k.handoff_pattern, k.output_pattern, k.cancelled_pattern,
                k.watch_pattern, *_fleet(k), k.requested, k.affinity_pattern]
    if role == "worker":
        # The fleet KV tier's keys are the workers' alone: KV reveals prompts, and a
        # planted block would poison every output computed from it.
        return [k.requests_pattern, k.output_pattern, k.cancelled_pattern, *_fleet(k), k.dead,
                k.isolated_pattern, k.kv_pattern, k.handoff_pattern, k.watch_pattern,
                k.affinity_pattern]
    return [k.requests_pattern, k.handoff_pattern, *_fleet(k), k.requested, k.affinity_pattern]


def acl_rules(role: str, namespace: str = "conveyor", version: int = 7) -> list[str]:
    """ACL rules for ``role``, to follow ``ACL SETUSER <name> reset on >PASSWORD`` (or
    ``user <name> reset on >PASSWORD`` in an ACL file): its keys, its channel, its commands.
    ``version`` 7 uses selectors (Redis >= 7); 6 gives the rules Redis 6.2 accepts."""
    _check(role, version)
    keys = Keys(namespace)  # validates the namespace
    # resetchannels: Redis 6.2 starts a reset user with every channel (acl-pubsub-default).
    channels = ["resetchannels"]
    if role != "observer":
        channels.append(f"&{keys.cancel_channel}")
    if version == 6 or role == "worker":
        commands = {"producer": PRODUCER_COMMANDS_6, "worker": WORKER_COMMANDS,
                    "observer": OBSERVER_COMMANDS_6}[role]
        if version == 7:
            commands = (*commands, *WORKER_COMMANDS_7)
        return [*(f"~{k}" for k in key_patterns(role, namespace)), *channels, "-@all",
                *(f"+{c}" for c in commands)]
    # Redis 7: the user itself has no keys; each selector grants commands on its keys.
    if role == "producer":
        own, selectors = ["ping", "multi", "exec", "discard", "publish"], _producer_selectors(keys)
    else:
        own, selectors = ["ping"], _observer_selectors(keys)
    return ["resetkeys", *channels, "-@all", *(f"+{c}" for c in own),
            *(_selector(keys, commands) for keys, commands in selectors)]


def _selector(keys: list[str], commands: list[str]) -> str:
    return "(" + " ".join([*keys, "-@all", *(f"+{c}" for c in commands)]) + ")"


def setuser_args(role: str, user: str, password: str, namespace: str = "conveyor",
                 version: int = 7) -> list[str]:
    """Arguments of ``ACL SETUSER`` that create (or reset) ``user`` with ``role``'s rules."""
    return [user, "reset", "on", f">{password}", *acl_rules(role, namespace, version)]
