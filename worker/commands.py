"""Worker-side CLI verbs (make-model, generate, worker, demo, bench); imported when one runs."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from producer.paths import default_model_dir


def make_model_cmd(args: argparse.Namespace) -> int:
    from worker.modelgen import make_model

    out = Path(args.dir) if args.dir else default_model_dir(args.preset)
    if args.exist_ok and (out / "config.json").is_file():
        print(out)
        return 0
    if out.exists() and any(out.iterdir()):
        if not args.force:
            raise FileExistsError(f"{out} exists and is not empty (use --force to overwrite)")
        shutil.rmtree(out)
    make_model(out, preset=args.preset, arch=args.arch, seed=args.seed)
    print(out)
    return 0


def ensure_model(model: str | None, preset: str = "small") -> Path:
    """The given folder, or the preset model in the data folder, made on first use."""
    if model:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model folder (no config.json)")
        return path
    path = default_model_dir(preset)
    if not (path / "config.json").is_file():
        from worker.modelgen import make_model

        print(f"making the {preset} model in {path} ...", file=sys.stderr)
        make_model(path, preset=preset)
    return path


def generate_cmd(args: argparse.Namespace) -> int:
    from worker import Engine, SamplingParams

    engine = Engine(ensure_model(args.model), dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    for completion in engine.generate(list(args.prompts), params):
        print(f"[{completion.finish_reason}] {completion.text!r}")
    return 0


def worker_cmd(args: argparse.Namespace) -> int:
    from worker.fleet.config import WorkerConfig
    from worker.fleet.process import Worker

    engine = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens":
              args.max_num_batched_tokens, "dtype": args.dtype}
    if args.num_kv_blocks:
        engine["num_kv_blocks"] = args.num_kv_blocks
    if args.threads:
        engine["num_threads"] = args.threads
    if not args.chunked_prefill:
        engine["enable_chunked_prefill"] = False
    if args.max_prefill_chunk:
        engine["max_prefill_chunk"] = args.max_prefill_chunk
    config = WorkerConfig(model_dir=ensure_model(args.model),
                          served_model_name=args.served_model_name,
                          redis_url=args.redis, namespace=args.namespace,
                          engine=engine, drain_timeout_s=args.drain_timeout,
                          lease_ms=args.lease_ms, max_deliveries=args.max_deliveries,
                          heartbeat_interval_s=args.heartbeat_interval,
                          metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    if args.worker_id:
        config.worker_id = args.worker_id
    return Worker(config).run_until_signalled()


def demo_cmd(args: argparse.Namespace) -> int:
    from producer.redis_server import ensure_running
    from worker.demo import run_demo

    model_dir = ensure_model(args.model)
    redis_url = args.redis or ensure_running()
    run_demo(model_dir, redis_url, num_questions=args.requests, threads=args.threads)
    if not args.redis:
        print("the embedded Redis keeps running for later commands; stop it with "
              "`conveyor redis stop`")
    return 0


def bench_cmd(args: argparse.Namespace) -> int:
    from worker.bench.cli import bench_cmd as run_bench

    return run_bench(args)
