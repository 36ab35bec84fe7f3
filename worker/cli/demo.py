"""`conveyor demo`: a worker process, short questions and one long document, streamed live."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from producer.client.client import Client
from producer.client.models import decode_hash, is_live
from producer.client.stream_events import ChunkEvent, FinalEvent
from producer.paths import data_dir
from producer.wire.keys import Keys
from worker.bench.results.metrics import percentile

_TOPICS = ["the river", "a lighthouse", "the old library", "winter markets", "a clockmaker",
           "the harbour at dawn", "bees", "a mountain railway", "paper lanterns", "tide pools"]
MODEL = "demo"


def start_worker(model_dir: Path, redis_url: str, threads: int) -> tuple[subprocess.Popen, Path]:
    """A `conveyor worker` child process; returns it and its log file."""
    log = data_dir() / "demo-worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "worker.cli", "worker", "--model", str(model_dir),
           "--served-model-name", MODEL, "--redis", redis_url, "--name", f"demo-{os.getpid()}",
           "--threads", str(threads), "--max-num-batched-tokens", "512"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def wait_for_worker(client: Client, proc: subprocess.Popen, log: Path,
                    timeout: float = 180) -> None:
    key = Keys().worker(f"demo-{os.getpid()}")
    deadline = time.monotonic() + timeout
    # Its heartbeat says "starting" before it serves (the kind check): wait for a live one.
    while not is_live(decode_hash(client.redis.hgetall(key))):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"the demo worker did not start; its log ({log}):\n{tail}")
        time.sleep(0.2)


def start_kernel_build() -> bool:
    """Start the CPU kernels' build in the background where they are not built, and say which
    path the demo's worker serves on; whether a build is running."""
    from worker.host import kernel_build
    from worker.host.cpu_kernels import build_folder, start_background_build

    state = start_background_build()
    if state == kernel_build.READY:
        print("CPU kernels built: the worker serves with them", flush=True)
    elif state in (kernel_build.STARTED, kernel_build.BUILDING):
        print("CPU kernels building in the background; serving on the torch path "
              f"(build log: {build_folder().log})", flush=True)
        return True
    else:
        print(f"CPU kernels {'switched off' if state == 'off' else 'unavailable'}: "
              "serving on the torch path", flush=True)
    return False


def finish_kernel_build() -> None:
    """Wait for the CPU kernels' background build, so that the next start uses them."""
    from worker.host.cpu_kernels import build_folder, wait_for_build

    print("waiting for the CPU kernels' build to finish (the next start uses them) ...",
          flush=True)
    started = time.monotonic()
    built = wait_for_build()
    waited = time.monotonic() - started
    print(f"CPU kernels built (waited {waited:.1f} s): the next `conveyor demo` uses them"
          if built else f"CPU kernels could not be built (log: {build_folder().log}); "
          "demos keep to the torch path", flush=True)


def _prompts(rng: random.Random, num_questions: int, count_tokens: Callable[[str], int],
             max_model_len: int) -> list[tuple[str, int]]:
    """Short questions, then one long document cut to fit the served model's length."""
    questions = [(f"Tell me about {rng.choice(_TOPICS)}.", 48) for _ in range(num_questions)]
    chapters = [f"Chapter {i}: notes on {rng.choice(_TOPICS)} and {rng.choice(_TOPICS)}."
                for i in range(90)]
    document = "Summarise this document. " + " ".join(chapters)
    while len(chapters) > 1 and count_tokens(document) + 64 >= max_model_len:
        chapters = chapters[: len(chapters) * 3 // 4]
        document = "Summarise this document. " + " ".join(chapters)
    return questions + [(document, 64)]


class LiveView:
    """Redraws one line per request on a terminal; prints a progress line elsewhere."""

    def __init__(self, names: list[str], limits: list[int]) -> None:
        self.names, self.limits = names, limits
        self.tty = sys.stdout.isatty()
        self.drawn = 0
        self.last_print = 0.0

    def draw(self, produced: list[int], done: list[bool], texts: list[str], elapsed: float) -> None:
        total = sum(produced)
        if not self.tty:
            if time.monotonic() - self.last_print > 2 or all(done):
                print(f"{elapsed:6.1f}s  {sum(done)}/{len(done)} done, {total} tokens", flush=True)
                self.last_print = time.monotonic()
            return
        lines = []
        for name, n, limit, d, text in zip(self.names, produced, self.limits, done, texts,
                                           strict=True):
            bar = "#" * (20 * n // limit) + "." * (20 - 20 * n // limit)
            snippet = text.replace("\n", " ")[-40:]
            mark = "done" if d else "    "
            lines.append(f"{mark} {name:<10} [{bar}] {n:>3}/{limit:<3} {snippet}")
        lines.append(f"{elapsed:6.1f}s  {sum(done)}/{len(done)} done, {total} tokens, "
                     f"{total / max(elapsed, 1e-9):.0f} tokens/s")
        if self.drawn:
            sys.stdout.write(f"\x1b[{self.drawn}F")
        sys.stdout.write("".join(f"\x1b[2K{line}\n" for line in lines))
        sys.stdout.flush()
        self.drawn = len(lines)


def run_demo(model_dir: Path, redis_url: str, num_questions: int = 24,
             threads: int = 2) -> dict[str, float]:
    """Serve the demo workload through a worker process; returns the summary."""
    client = Client(redis_url)
    proc, log = start_worker(model_dir, redis_url, threads)
    try:
        print(f"starting a worker (log: {log}) ...", flush=True)
        wait_for_worker(client, proc, log)
        info = client.model_info(MODEL) or {}
        tokenizer = client.tokenizer(MODEL)
        work = _prompts(random.Random(0), num_questions,
                        lambda text: len(tokenizer.encode(text).ids) if tokenizer else 0,
                        int(info.get("max_model_len", 4096)))
        start = time.perf_counter()
        ids = [client.submit(p, model=MODEL, max_tokens=m, temperature=0.8, seed=i,
                             ignore_eos=True) for i, (p, m) in enumerate(work)]
        index = {rid: i for i, rid in enumerate(ids)}
        names = [f"q{i}" for i in range(num_questions)] + ["document"]
        view = LiveView(names, [m for _, m in work])
        produced, done = [0] * len(ids), [False] * len(ids)
        texts = [""] * len(ids)
        errors: list[str] = []
        first: dict[int, float] = {}
        for rid, event in client.follow_many(ids, timeout=600):
            i = index[rid]
            if isinstance(event, ChunkEvent):
                first.setdefault(i, time.perf_counter() - start)
                produced[i] += len(event.token_ids)
                texts[i] += event.text
            elif isinstance(event, FinalEvent):
                done[i] = True
                if event.error:
                    texts[i] = f"error: {event.error}"
                    errors.append(f"{names[i]}: {event.error}")
            view.draw(produced, done, texts, time.perf_counter() - start)
        elapsed = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        client.close()
    total = sum(produced)
    ttfts = list(first.values())
    for line in errors:
        print(f"failed: {line}")
    summary = {"requests": len(ids), "failed": len(errors), "tokens": total, "seconds": elapsed,
               "tokens_per_s": total / elapsed, "ttft_p50_s": percentile(ttfts, 50),
               "ttft_p99_s": percentile(ttfts, 99)}
    print(f"\n{len(ids)} requests ({len(errors)} failed), {total} tokens in {elapsed:.1f} s: "
          f"{summary['tokens_per_s']:.0f} tokens/s; TTFT p50 {summary['ttft_p50_s'] * 1000:.0f} ms,"
          f" p99 {summary['ttft_p99_s'] * 1000:.0f} ms")
    return summary
