"""The worker-side CLI verbs (make-model, generate, worker, demo): their arguments and handlers.

Importing this module loads no torch; a handler imports what it runs when it runs.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import structlog

from producer.paths import default_model_dir
from scheduler.step_cost import MIN_PREFILL_TOKENS
from worker.cli.redis_verbs import add_redis_url_option
from worker.engine.config import EngineConfig, field_default
from worker.fleet.config import WorkerConfig

log = structlog.get_logger(__name__)


def add_worker_parsers(subparsers: Any) -> None:
    """Add make-model, generate, worker and demo to the `conveyor` command's subparsers."""
    p = subparsers.add_parser("make-model",
                              help="write a small deterministic checkpoint (no model hub)")
    p.add_argument("dir", nargs="?",
                   help="output folder (default: the data folder's models/PRESET)")
    p.add_argument("--preset", choices=["tiny", "small", "1b", "8b"], default="small",
                   help="model size: tiny (tests, under 1M parameters), small (about 32M), or "
                   "Llama-3.2-1B's and Llama-3.1-8B's shapes and 128,256-token vocabulary "
                   "(1b, 8b: bfloat16, 2.5 and 16 GB)")
    p.add_argument("--arch", choices=["llama", "qwen2", "mistral"], default="llama",
                   help="architecture written to config.json")
    p.add_argument("--seed", type=int, default=0,
                   help="weight seed: the same arguments always give the same files")
    p.add_argument("--vocab-size", type=int, choices=[1024, 8192, 32000, 128256],
                   help="the vocabulary (default: the preset's; each has a tokenizer, 32000 a "
                   "Llama-2-sized one for benchmarks, 128256 Llama 3's)")
    p.add_argument("--chat-template", choices=["plain", "qwen", "llama3"], default="plain",
                   help="the tokenizer's chat template: plain role lines, or one with tools "
                   "support (qwen: Hermes <tool_call> blocks; llama3: Llama 3.1 JSON calls)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the weights' precision (default: the preset's: bfloat16 for 1b and "
                   "8b, float32 otherwise)")
    p.add_argument("--device", default="cpu",
                   help="where the weights are drawn, a file at a time: cpu, or cuda to make "
                   "a real size on a GPU machine (its generator draws other numbers than "
                   "the CPU's; default: cpu)")
    p.add_argument("--force", action="store_true",
                   help="delete and make again a folder make-model made (it holds "
                   ".conveyor-model); any other folder is refused")
    p.add_argument("--exist-ok", action="store_true",
                   help="do nothing when the folder already holds a model (config.json)")
    p.set_defaults(handler=make_model_cmd)

    p = subparsers.add_parser("generate", help="run prompts through the offline engine (no Redis)")
    p.add_argument("prompts", nargs="+", help="prompt texts")
    p.add_argument("--model", help="checkpoint folder (default: the small preset, made if missing)")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: none, random)")
    p.add_argument("--dtype", default=field_default(EngineConfig, "dtype"),
                   help="precision: auto (float32 on CPU, bfloat16 on CUDA), float32, float64, "
                   "bfloat16 or float16")
    p.set_defaults(handler=generate_cmd)

    _add_serve_parser(subparsers)

    p = subparsers.add_parser(
        "demo",
        help="start Redis and a worker, stream short questions and one long document live",
        description="Makes the small model if missing, starts the embedded Redis (unless --redis "
        "is given) and a worker process, submits short questions and one long document, shows "
        "them streaming, and ends with a summary (tokens/s, TTFT p50/p99).",
    )
    p.add_argument("--model", help="checkpoint folder (default: the small preset, made if missing)")
    p.add_argument("--requests", type=int, default=24, help="number of short questions")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the worker")
    add_redis_url_option(p)
    p.set_defaults(handler=demo_cmd)


def _add_serve_parser(subparsers: Any) -> None:
    # Every default comes from WorkerConfig or EngineConfig: the flags cannot drift from them.
    def worker(name: str) -> Any:
        return field_default(WorkerConfig, name)

    def engine(name: str) -> Any:
        return field_default(EngineConfig, name)

    p = subparsers.add_parser("worker", help="serve a model from Redis until SIGTERM (then drain)")
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--served-model-name", help="name producers address (default: folder name)")
    add_redis_url_option(p)
    p.add_argument("--namespace", default=worker("namespace"),
                   help="prefix of every conveyor key: the fleet's namespace")
    p.add_argument("--name", dest="worker_id", help="worker id (default: HOST-PID)")
    p.add_argument("--max-num-seqs", type=int, default=engine("max_num_seqs"),
                   help="requests running at once (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=engine("max_num_batched_tokens"),
                   help="token budget of a step, at least --max-num-seqs "
                   "(default: %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="device KV pool in blocks (default: on a GPU, what "
                   "--gpu-memory-utilization of its memory leaves after the weights and a "
                   "step's activations; elsewhere 0.5 GiB; capped at what --max-num-seqs "
                   "full-length sequences use)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=engine("gpu_memory_utilization"), metavar="F",
                   help="the share of the GPU's memory the worker may hold, its KV pool "
                   "sized from it (default: %(default)s)")
    p.add_argument("--attention-backend", choices=["auto", "torch", "paged"],
                   default=engine("attention_backend"),
                   help="paged: attention reads the KV pool through the block tables in place "
                   "(Triton's kernel on CUDA); torch: gathers each context first; auto: paged "
                   "on CUDA where triton is installed, else torch (default: %(default)s)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="never capture decode steps in CUDA graphs (captured by default on "
                   "CUDA with the paged backend)")
    p.add_argument("--no-chunked-prefill", dest="chunked_prefill", action="store_false",
                   help="prefill each prompt in one step (needs --max-num-batched-tokens >= the "
                   "model's max length)")
    p.add_argument("--max-prefill-chunk", type=int, default=None, metavar="N",
                   help="cap on one request's prefill chunk in a step (default: the budget)")
    p.add_argument("--itl-target-ms", type=float, default=None, metavar="MS",
                   help="while requests decode, hold each step's prefill to what keeps the "
                   "step's predicted time within MS (a cost model of the engine's own steps; "
                   f"a prompt still gains at least {MIN_PREFILL_TOKENS} tokens a step; "
                   "overlapped steps are timed on the runner thread); needs chunked prefill; "
                   "0 or unset: off")
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                   help="schedule each step while the one before runs: auto is on for CUDA "
                   "and off on a CPU, where it was measured slower; a prefill worker never "
                   "does (default: %(default)s)")
    p.add_argument("--stream-interval-ms", type=float, default=worker("stream_interval_ms"),
                   metavar="MS", help="publish a decoding request's tokens at most once every "
                   "MS ms (its first token and its end at once, every token where they come "
                   "slower): a bounded number of writes to Redis and reads by its clients "
                   "whatever the step rate, each token up to MS later; 0: every step "
                   "(default: %(default)s)")
    p.add_argument("--stream-interval", type=int, default=None, metavar="N",
                   help="deprecated (a count of steps means nothing to a reader): also publish "
                   "a request's held tokens once they number N")
    sim = p.add_mutually_exclusive_group()
    sim.add_argument("--simulate-step-ms", type=float, default=None, metavar="MS",
                     help="a SIMULATED engine, to test the fleet at a GPU's speed: no forward "
                     "and no weights, each step MS ms, tokens a documented function of each "
                     "request's seed (worker/engine/simulated.py). Never for real traffic: "
                     "it registers its model as simulated, and real workers refuse to serve "
                     "that name beside it")
    sim.add_argument("--simulate-cost", default=None, metavar="FILE|PRESET",
                     help="the same, steps costed a + b*prefill tokens + c*decode rows + "
                     "d*context tokens: a JSON file of base_ms, prefill_token_ms, "
                     "decode_row_ms, context_token_ms, or a preset (h200-8b)")
    p.add_argument("--heartbeat-interval", type=float, default=worker("heartbeat_interval_s"),
                   metavar="S", help="seconds between heartbeats (status and load in Redis; "
                   "default: %(default)s)")
    p.add_argument("--housekeeping-interval", type=float,
                   default=worker("housekeeping_interval_s"), metavar="S",
                   help="seconds between the reaper's housekeeping: trimming served entries "
                   "off the request streams, removing dead workers' consumers and stale "
                   "workers, checking for closed lanes (default: %(default)s)")
    p.add_argument("--dtype", default=engine("dtype"),
                   help="precision: auto (float32 on CPU, bfloat16 on CUDA), float32, float64, "
                   "bfloat16 or float16 (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for this process (default: torch's own choice)")
    p.add_argument("--place-threads", action=argparse.BooleanOptionalAction, default=True,
                   help="on a CPU engine whose one or two threads fill the process's CPUs "
                   "(one to spare at most), pin each engine thread to a CPU and the I/O "
                   "threads beside the last (worker/host/cpu_placement.py; default: on)")
    p.add_argument("--lease-ms", type=int, default=worker("lease_ms"),
                   help="in-flight entries idle this long are claimed by other workers "
                   "(default: %(default)s)")
    p.add_argument("--max-deliveries", type=int, default=worker("max_deliveries"),
                   help="a request delivered more often goes to the dead-letter stream "
                   "(default: %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=worker("drain_timeout_s"),
                   help="seconds in-flight requests may take to finish after SIGTERM "
                   "(default: %(default)s)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="N",
                   help="serve Prometheus metrics on http://HOST:N/metrics (0: any free port; "
                   "default: not served)")
    p.add_argument("--metrics-host", default=worker("metrics_host"), metavar="ADDR",
                   help="address the metrics server binds (default: all interfaces)")
    p.add_argument("--allow-eviction", action="store_true",
                   help="serve even if Redis's maxmemory-policy may evict keys (an evicted "
                   "request stream loses its requests; default: refuse to start)")
    p.add_argument("--role", choices=["both", "prefill", "decode"], default=worker("role"),
                   help="prefill: compute prompts and hand requests on after their first "
                   "token; decode: continue handed-on requests only; both: whole requests, "
                   "and handed-on ones too (default: %(default)s)")
    p.add_argument("--kv-redis", metavar="URL", default=None,
                   help="Redis for the fleet KV tier (default: the queues' Redis; its own "
                   "Redis is the production choice)")
    skip_s = worker("kv_breaker_open_s")
    p.add_argument("--kv-timeout", type=float, default=worker("kv_timeout_s"), metavar="S",
                   help="seconds a round trip to the KV tier may take; one that takes longer "
                   f"skips the tier (hand on without KV, recompute) for {skip_s:g} s "
                   "(default: %(default)s)")
    p.add_argument("--handoff-max-waiting", type=int, default=worker("handoff_max_waiting"),
                   metavar="N", help="a prefill worker reads no new request while N wait in "
                   "its model's handoff streams for a decode worker (default: %(default)s)")
    p.add_argument("--kv-share-prefixes", action="store_true",
                   help="put computed prompt blocks in the fleet KV tier and reuse other "
                   "workers' blocks on a local prefix-cache miss (default: off)")
    p.add_argument("--no-affinity", dest="affinity", action="store_false",
                   help="no affinity lane of its own and no advertised prefixes: read the "
                   "shared lanes only, as plain pull does (default: prefix affinity on; "
                   "docs/affinity.md)")
    p.add_argument("--affinity-delay-ms", type=int, default=worker("affinity_delay_ms"),
                   metavar="MS", help="how long a request waits in a full worker's affinity "
                   "lane before an idle worker takes it over; a gone or draining worker's "
                   "are taken at once (default: %(default)s)")
    p.set_defaults(handler=worker_cmd)


def make_model_cmd(args: argparse.Namespace) -> int:
    """Write a checkpoint and mark its folder as one make-model made; only such a folder may
    ``--force`` delete (FileExistsError, exit 2, for any other)."""
    from worker.modelgen.ensure import make_marked  # loads torch: not at parse time
    from worker.modelgen.make_model import MARKER_FILE, is_marked_folder

    out = Path(args.dir) if args.dir else default_model_dir(args.preset)
    if args.exist_ok and (out / "config.json").is_file():
        print(out)
        return 0
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder")
    if out.exists() and any(out.iterdir()):
        if not args.force:
            raise FileExistsError(f"{out} exists and is not empty (use --force to make it "
                                  "again, if make-model made it)")
        if not is_marked_folder(out):
            raise FileExistsError(f"{out} is not a folder make-model made (it has no "
                                  f"{MARKER_FILE}): --force deletes only those; pick another "
                                  "folder, or delete this one yourself")
        shutil.rmtree(out)
    make_marked(out, preset=args.preset, arch=args.arch, seed=args.seed,
                chat_template=args.chat_template, vocab_size=args.vocab_size,
                dtype=args.dtype, device=args.device)
    print(out)
    return 0


def generate_cmd(args: argparse.Namespace) -> int:
    from worker import Engine, SamplingParams
    from worker.modelgen.ensure import ensure_model  # loads torch: not at parse time

    engine = Engine(ensure_model(args.model), dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    for completion in engine.generate(list(args.prompts), params):
        print(f"[{completion.finish_reason}] {completion.text!r}")
    return 0


def worker_cmd(args: argparse.Namespace) -> int:
    from worker.fleet.process import Worker

    return Worker(worker_config(args)).run_until_signalled()


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The WorkerConfig `conveyor worker`'s flags ask for (the model made if missing)."""
    from worker.modelgen.ensure import ensure_model  # loads torch: not at parse time

    engine = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens":
              args.max_num_batched_tokens, "dtype": args.dtype}
    if args.num_kv_blocks is not None:  # (0 is refused by the config, not dropped)
        engine["num_kv_blocks"] = args.num_kv_blocks
    engine["gpu_memory_utilization"] = args.gpu_memory_utilization
    engine["attention_backend"] = args.attention_backend
    if args.enforce_eager:
        engine["enforce_eager"] = True
    if args.threads is not None:
        engine["num_threads"] = args.threads
    if not args.chunked_prefill:
        engine["enable_chunked_prefill"] = False
    if args.max_prefill_chunk is not None:
        engine["max_prefill_chunk"] = args.max_prefill_chunk
    if args.itl_target_ms is not None:
        engine["itl_target_ms"] = args.itl_target_ms
    if args.async_scheduling != "auto":
        engine["async_scheduling"] = args.async_scheduling == "on"
    if args.simulate_step_ms is not None:
        engine["simulate_step_ms"] = args.simulate_step_ms
    if args.simulate_cost is not None:
        engine["simulate_cost"] = args.simulate_cost
    config = WorkerConfig(model_dir=ensure_model(args.model),
                          served_model_name=args.served_model_name,
                          redis_url=args.redis, namespace=args.namespace,
                          engine=engine, drain_timeout_s=args.drain_timeout,
                          lease_ms=args.lease_ms, max_deliveries=args.max_deliveries,
                          heartbeat_interval_s=args.heartbeat_interval,
                          housekeeping_interval_s=args.housekeeping_interval,
                          metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                          allow_eviction=args.allow_eviction, role=args.role,
                          place_threads=args.place_threads,
                          kv_redis_url=args.kv_redis, kv_share_prefixes=args.kv_share_prefixes,
                          kv_timeout_s=args.kv_timeout, affinity=args.affinity,
                          affinity_delay_ms=args.affinity_delay_ms,
                          handoff_max_waiting=args.handoff_max_waiting,
                          stream_interval=_deprecated_interval(args.stream_interval),
                          stream_interval_ms=args.stream_interval_ms,
                          **({"worker_id": args.worker_id} if args.worker_id else {}))
    return config


def _deprecated_interval(tokens: int | None) -> int | None:
    if tokens is not None:
        log.warning("--stream-interval N is deprecated: --stream-interval-ms MS bounds each "
                    "stream's writes in time, whatever the step rate (default 50)",
                    stream_interval=tokens)
    return tokens


def demo_cmd(args: argparse.Namespace) -> int:
    from producer.redis.server import ensure_running
    from worker.cli.demo import finish_kernel_build, run_demo, start_kernel_build
    from worker.modelgen.ensure import ensure_model  # loads torch: not at parse time

    building = start_kernel_build()  # first: it compiles while the model is made and served
    model_dir = ensure_model(args.model)
    redis_url = args.redis or ensure_running()
    run_demo(model_dir, redis_url, num_questions=args.requests, threads=args.threads)
    if building:
        finish_kernel_build()
    if not args.redis:
        print("the embedded Redis keeps running for later commands; stop it with "
              "`conveyor redis stop`")
    return 0
