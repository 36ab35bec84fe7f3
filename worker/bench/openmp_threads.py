"""Decode steps on the main thread and on another thread, with and without the main
thread's OpenMP pool: why a worker releases it (worker/host/openmp.py).

    python -m worker.bench.openmp_threads [--batch 16] [--threads 2] [--rounds 4]

One engine decoding ``batch`` requests of 128-token prompts on the small preset, stepped in
rounds of 10 steps: on the main thread; on a second, long-lived thread while the main
thread's pool exists (as in a worker that built its engine on the main thread); and on
that thread after the main thread released its pool. Medians of every round's steps.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from worker.bench.sampling_steps import decoding_engine, model_with_vocab
from worker.host.openmp import release_thread_pool

STEPS_PER_ROUND = 10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = decoding_engine(model_with_vocab(8192, args.models), "greedy", args.batch,
                             args.threads)

    def steps(out: list[float]) -> None:
        for _ in range(STEPS_PER_ROUND):
            start = time.perf_counter()
            engine.step()
            out.append(time.perf_counter() - start)

    jobs: queue.Queue[list[float] | None] = queue.Queue()
    done = threading.Semaphore(0)

    def stepper() -> None:
        while (out := jobs.get()) is not None:
            steps(out)
            done.release()

    thread = threading.Thread(target=stepper, daemon=True)
    thread.start()
    times: dict[str, list[float]] = {"main thread": [], "other thread, main pool kept": [],
                                     "other thread, main pool released": []}
    released = False
    for _ in range(args.rounds):
        steps(times["main thread"])  # the main thread's pool is (re)made here
        jobs.put(times["other thread, main pool kept"])
        done.acquire()
        released = release_thread_pool()
        jobs.put(times["other thread, main pool released"])
        done.acquire()
    jobs.put(None)
    thread.join()
    print(f"batch {args.batch}, {args.threads} threads, {args.rounds} rounds of "
          f"{STEPS_PER_ROUND} steps (pool released: {released})")
    for name, values in times.items():
        print(f"  {name:34} {statistics.median(values) * 1e3:6.2f} ms a step (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
