"""Redis ACL rules that limit a producer, a worker and an observer to their keys and commands.

docs/security.md shows them for the default namespace; tests apply them to a real server
and run a request through, so the list stays what the code actually sends. Redis 6.2 and
7 both accept these rules (no selectors, no read/write key permissions).
"""

from __future__ import annotations

from producer.wire.keys import Keys

ROLES = ("producer", "worker", "observer")

# Commands a producer (Client / AsyncClient / producer.queues) sends, and why.
PRODUCER_COMMANDS = (
    "ping",  # health check of an idle connection
    "xadd",  # submit
    "evalsha", "eval", "script|load",  # submit(max_queue=...): reloaded after a Redis restart
    "exists", "xinfo", "xlen", "xrange",  # run by that script; lane depths (producer.queues)
    "xread",  # stream, result, follow_many
    "xrevrange",  # a stream's last entry: resuming after its end, `conveyor tail`
    "set", "publish", "multi", "exec", "discard",  # cancel: marker and announcement at once
    "hget", "hgetall", "scan",  # models, model_info, tokenizer; live workers (heartbeats)
)

# Commands a worker (worker/fleet) sends, and why.
WORKER_COMMANDS = (
    "ping",  # health checks, also on the subscribed connection
    "info",  # at start: refuse a Redis whose maxmemory-policy may evict request streams
    "client|setname",  # each thread names its connection ({worker_id}:{thread}) for CLIENT LIST
    "xgroup|create",  # the consumer group, recreated if a Redis restart lost it
    "xgroup|delconsumer",  # dead workers' consumers, once they hold no pending entry
    "xreadgroup", "xack",  # intake; acknowledged after the final entry
    "xpending", "xclaim", "xautoclaim",  # leases, reaping dead workers' entries, delivery counts
    "xadd", "expire", "xrange", "xrevrange",  # output streams, dead letters, resumption
    "exists",  # cancellation markers
    "get", "incr",  # runs alone of a suspect request (poison isolation)
    "subscribe", "unsubscribe",  # the cancel channel
    "hset", "del",  # heartbeat hash (removed at exit) and the model hash
    "evalsha", "eval", "script|load",  # lease renewal, reloaded after a Redis restart
    "xinfo", "xlen", "xtrim", "multi", "exec", "discard",  # lane depths, trimming served requests
)

# Commands `conveyor top` (producer.top) sends: read-only.
OBSERVER_COMMANDS = (
    "ping",
    "scan", "hgetall",  # worker heartbeats and model hashes
    "xinfo", "xlen", "xrange",  # lane depths and pending counts (producer.queues)
)
COMMANDS = {"producer": PRODUCER_COMMANDS, "worker": WORKER_COMMANDS,
            "observer": OBSERVER_COMMANDS}


def key_patterns(role: str, namespace: str = "conveyor") -> list[str]:
    """Glob patterns of the keys ``role`` may touch."""
    ns = Keys(namespace).ns
    shared = [f"{ns}:req:*", f"{ns}:out:*", f"{ns}:model:*", f"{ns}:cancelled:*"]
    if role == "producer":
        # Heartbeats are read (HGETALL) to tell which models have a live worker; the
        # producer has no command that writes a hash or deletes a key.
        return [*shared, f"{ns}:worker:*"]
    if role == "worker":
        return [*shared, f"{ns}:dead", f"{ns}:worker:*", f"{ns}:isolated:*"]
    if role == "observer":
        return [f"{ns}:req:*", f"{ns}:model:*", f"{ns}:worker:*"]
    raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")


def acl_rules(role: str, namespace: str = "conveyor") -> list[str]:
    """ACL rules for ``role``, to follow ``ACL SETUSER <name> reset on >PASSWORD`` (or
    ``user <name> reset on >PASSWORD`` in an ACL file): its keys, its channel, its commands."""
    keys = key_patterns(role, namespace)  # validates role and namespace
    # resetchannels: Redis 6.2 starts a reset user with every channel (acl-pubsub-default).
    channels = ["resetchannels"]
    if role != "observer":
        channels.append(f"&{Keys(namespace).cancel_channel}")
    return [*(f"~{k}" for k in keys), *channels, "-@all", *(f"+{c}" for c in COMMANDS[role])]


def setuser_args(role: str, user: str, password: str, namespace: str = "conveyor") -> list[str]:
    """Arguments of ``ACL SETUSER`` that create (or reset) ``user`` with ``role``'s rules."""
    return [user, "reset", "on", f">{password}", *acl_rules(role, namespace)]
