"""The host-side price of a step: scheduling, the runner's block tables and the attention
metadata, without the model.

    python -m worker.bench.step_overhead [--running 256] [--waiting 1000] [--steps 200]

A scheduler with ``running`` decoding requests (16–128-token prompts, block size 16) and
``waiting`` more queued behind them; each measured step is what the engine does around
its forward: ``schedule()``, the runner's persistent block-table rows, the step's
AttentionMetadata, and ``update()`` with one sampled token per request.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvstore import BlockPool, KVCacheManager
from producer.long_lived import freeze_long_lived_objects
from scheduler import Request, Scheduler, SchedulerConfig
from worker.attention.metadata import AttentionMetadata
from worker.engine.block_table_rows import BlockTableRows

BLOCK_SIZE = 16


def busy_scheduler(num_running: int, num_waiting: int) -> Scheduler:
    """A scheduler whose ``num_running`` running requests all decode, ``num_waiting`` behind."""
    rng = random.Random(0)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=num_running,
                                  max_model_len=4096),
                  KVCacheManager(BlockPool(100_000), BLOCK_SIZE))
    for i in range(num_running + num_waiting):
        s.add_request(Request(f"r{i}", [1] * rng.randint(16, 128), max_tokens=10_000))
    return s


class HostStep:
    """One engine step minus the model: what `one()` times."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.rows = BlockTableRows()
        # Until every running slot decodes, so measured steps are the steady state.
        for _ in range(200):
            self.one()
            if all(r.num_output_tokens for r in scheduler.running):
                break

    def one(self):
        out = self.scheduler.schedule()
        placed = self.rows.apply(out)
        seq_lens = [c.start_position + c.num_tokens for c in out.chunks]
        width = -(-max(seq_lens) // BLOCK_SIZE)
        meta = AttentionMetadata.from_block_tables(
            [c.num_tokens for c in out.chunks], seq_lens, self.rows.gather(placed, width),
            BLOCK_SIZE, input_ids=[t for c in out.chunks for t in c.token_ids])
        self.scheduler.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
        return out, meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--waiting", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    step = HostStep(busy_scheduler(args.running, args.waiting))
    freeze_long_lived_objects()  # as a worker process does once its engine is built
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step.one()
        times.append(time.perf_counter() - start)
    print(f"{args.running} running, {args.waiting} waiting: scheduler + block tables + "
          f"metadata {statistics.median(times) * 1e3:.3f} ms a step (median of {args.steps}), "
          f"best {min(times) * 1e3:.3f} ms")
    # This host's speed wanders by up to 2x within seconds (a pure-Python loop shows it
    # too): the medians of successive windows show the quick and the slow phases apart.
    window = max(1, min(100, args.steps // 5))
    medians = [statistics.median(times[i:i + window]) * 1e3
               for i in range(0, len(times) - window + 1, window)]
    print(f"medians of each {window} steps: {min(medians):.3f} to {max(medians):.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
