"""The systems one bench invocation measures on the same model and workload."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.bench.results.records import RunResult
from worker.bench.run.runner_fleet import FleetTarget, run_fleet
from worker.bench.run.workloads import WorkItem
from worker.engine.config import field_default
from worker.fleet.config import WorkerConfig
from worker.host.cpu_placement import plan


@dataclass
class System:
    """A named way of serving the workload; ``run(repeat)`` serves it once."""

    name: str
    run: Callable[[int], RunResult]
    # What the bench prints before each run.
    describe: str


def choose_systems(args: argparse.Namespace, model_dir: Path, config: dict[str, Any],
                   items: list[WorkItem], redis_url: str, out_dir: Path) -> list[System]:
    """The fleet, then each alternative the arguments ask for, in that order."""
    engine = engine_settings(args)
    if getattr(args, "disaggregate", False):
        # Same cores either way: two workers of `--threads` each, mixed or split by role.
        flags = worker_flags(engine, args.threads)
        return [_fleet("mixed", engine, args, model_dir, items, redis_url, out_dir,
                       more=(tuple(flags),)),
                _fleet("disaggregated", engine, args, model_dir, items, redis_url, out_dir,
                       roles=("prefill", "decode"))]
    more = (tuple(worker_flags(engine, args.threads)),) * (getattr(args, "workers", 1) - 1)
    systems = [_fleet("fleet", engine, args, model_dir, items, redis_url, out_dir, more=more)]
    if getattr(args, "plain_pull", False):
        systems.append(_fleet("fleet-plain-pull", engine, args, model_dir, items, redis_url,
                              out_dir, more=more, affinity=False))
    if args.chunked_prefill == "off":
        systems.append(_fleet("fleet-chunked-off", chunked_off(engine, config), args, model_dir,
                              items, redis_url, out_dir))
    if args.offline:
        from worker.bench.run.runner_offline import run_offline

        settings = {**engine, "num_threads": args.threads}
        systems.append(System("offline", lambda _: run_offline(
            model_dir, items, args.concurrency, settings, args.timeout),
            "the engine in this process, no Redis"))
    baselines = args.baseline or []
    if baselines and _simulated(engine):
        raise ValueError("--baseline runs the real model: it cannot stand beside a "
                         "simulated engine")
    if "hf-static" in baselines:
        from worker.bench.run.baseline_hf import run_hf_static

        systems.append(System("hf-static", lambda _: run_hf_static(
            model_dir, items, args.hf_batch_size, args.threads),
            f"transformers generate in static batches of {args.hf_batch_size}"))
    if "hf-cb" in baselines:
        from worker.bench.run.baseline_hf import has_continuous_batching, run_hf_continuous

        if not has_continuous_batching():  # said before any run, not after the others
            raise ValueError("--baseline hf-cb: this transformers has no continuous "
                             "batching (generate_batch)")
        systems.append(System("hf-cb", lambda _: run_hf_continuous(
            model_dir, items, args.threads, args.timeout),
            "transformers' continuous batching (generate_batch)"))
    return systems


# Engine settings that make a simulated engine (worker/engine/simulated.py).
SIMULATE_SETTINGS = ("simulate_step_ms", "simulate_cost")


def _simulated(engine: dict[str, Any]) -> bool:
    return any(engine.get(name) is not None for name in SIMULATE_SETTINGS)


# The workers' own default: a bench that does not name an interval passes none.
DEFAULT_INTERVAL_MS = field_default(WorkerConfig, "stream_interval_ms")


def _fleet(name: str, engine: dict[str, Any], args: argparse.Namespace, model_dir: Path,
           items: list[WorkItem], redis_url: str, out_dir: Path,
           more: tuple[tuple[str, ...], ...] = (), roles: tuple[str, ...] = (),
           affinity: bool = True) -> System:
    """A fleet of one worker, or of ``1 + len(more)`` workers, or one worker per role;
    ``affinity`` False: plain pull (workers and the client without prefix affinity)."""
    flags = worker_flags(engine, args.threads)
    if getattr(args, "kv_share_prefixes", False):
        if _simulated(engine):
            raise ValueError("--kv-share-prefixes moves KV: a simulated engine holds none")
        flags.append("--kv-share-prefixes")
        more = tuple((*f, "--kv-share-prefixes") for f in more)
    if not affinity:
        flags.append("--no-affinity")
        more = tuple((*f, "--no-affinity") for f in more)
    interval = getattr(args, "stream_interval_ms", DEFAULT_INTERVAL_MS)
    if interval != DEFAULT_INTERVAL_MS:
        flags += ["--stream-interval-ms", f"{interval:g}"]
        more = tuple((*f, "--stream-interval-ms", f"{interval:g}") for f in more)
    tokens = getattr(args, "stream_interval", None)  # deprecated: a count of steps
    if tokens is not None:
        flags += ["--stream-interval", str(tokens)]
        more = tuple((*f, "--stream-interval", str(tokens)) for f in more)
    # One worker places its threads (worker/host/cpu_placement.py), and the bench puts its
    # client and its own Redis on the worker's I/O CPUs meanwhile, as a deployment on a
    # shared machine would; several workers on these CPUs are left to the OS.
    single = not more and len(roles) <= 1
    placement = plan(args.threads) if args.place_threads and single else None
    if placement is None:
        flags.append("--no-place-threads")
        more = tuple((*f, "--no-place-threads") for f in more)
    if roles:
        first, *rest = [[*flags, "--role", role] for role in roles]
        target = FleetTarget(model_dir, redis_url, args.namespace, first, out_dir,
                             tuple(tuple(f) for f in rest), placement, args.redis is None)
        describe = " + ".join(f"a {role} worker" for role in roles)
    else:
        target = FleetTarget(model_dir, redis_url, args.namespace, flags, out_dir, more,
                             placement, args.redis is None, affinity)
        describe = (f"{1 + len(more)} worker processes" if more else "a worker process") \
            + ", this process the client"
    describe += f", each stream written at most every {interval:g} ms"
    if tokens is not None:
        describe += f" or {tokens} tokens"
    if _simulated(engine):
        describe += ", SIMULATED engine (no forward: worker/engine/simulated.py)"
    settings = {"engine": engine, "threads": args.threads, "workers": 1 + len(more)
                if not roles else len(roles), "roles": list(roles) or ["both"],
                "stream_interval_ms": interval, "stream_interval": tokens}
    return System(name, lambda repeat: run_fleet(name, target, items, args.concurrency,
                                                 settings, args.timeout, repeat), describe)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Engine settings of the fleet worker and the offline engine alike."""
    settings: dict[str, Any] = {"max_num_seqs": args.max_num_seqs,
                                "max_num_batched_tokens": args.max_num_batched_tokens,
                                "enable_chunked_prefill": True}
    if args.num_kv_blocks is not None:  # (0 is refused by the engine's config, not dropped)
        settings["num_kv_blocks"] = args.num_kv_blocks
    if args.max_prefill_chunk is not None:
        settings["max_prefill_chunk"] = args.max_prefill_chunk
    if getattr(args, "itl_target_ms", None):
        settings["itl_target_ms"] = args.itl_target_ms
    if getattr(args, "attention_backend", "auto") != "auto":
        settings["attention_backend"] = args.attention_backend
    if getattr(args, "enforce_eager", False):
        settings["enforce_eager"] = True
    for name in SIMULATE_SETTINGS:  # a simulated engine: said in results
        if getattr(args, name, None) is not None:
            settings[name] = getattr(args, name)
    return settings


def chunked_off(engine: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """``engine`` with chunked prefill off.

    Without chunking a prompt is prefilled in one step, so the step budget must hold the
    longest sequence the model takes (the engine refuses a smaller one).
    """
    budget = max(engine["max_num_batched_tokens"], int(config["max_position_embeddings"]))
    off = {**engine, "enable_chunked_prefill": False, "max_num_batched_tokens": budget}
    off.pop("max_prefill_chunk", None)
    return off


def worker_flags(settings: dict[str, Any], threads: int) -> list[str]:
    """`conveyor worker` flags for these engine settings."""
    flags = ["--threads", str(threads), "--max-num-seqs", str(settings["max_num_seqs"]),
             "--max-num-batched-tokens", str(settings["max_num_batched_tokens"])]
    if "num_kv_blocks" in settings:
        flags += ["--num-kv-blocks", str(settings["num_kv_blocks"])]
    if "max_prefill_chunk" in settings:
        flags += ["--max-prefill-chunk", str(settings["max_prefill_chunk"])]
    if "itl_target_ms" in settings:
        flags += ["--itl-target-ms", str(settings["itl_target_ms"])]
    if not settings["enable_chunked_prefill"]:
        flags.append("--no-chunked-prefill")
    if "attention_backend" in settings:
        flags += ["--attention-backend", settings["attention_backend"]]
    if settings.get("enforce_eager"):
        flags.append("--enforce-eager")
    if settings.get("simulate_step_ms") is not None:
        flags += ["--simulate-step-ms", str(settings["simulate_step_ms"])]
    if settings.get("simulate_cost") is not None:
        flags += ["--simulate-cost", str(settings["simulate_cost"])]
    return flags
