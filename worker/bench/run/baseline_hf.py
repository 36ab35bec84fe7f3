"""The `hf-static` baseline: transformers `generate` in static, left-padded batches.

Every request is there at t=0 and batches go in workload order. A batch decodes until its
longest request is done (greedy, EOS suppressed), so only each request's own max_tokens
count as useful tokens. `generate` does not stream: the step times recorded (a stopping
criterion sees every step) give TTFT and ITL as if it did, which flatters it; E2E is when
its batch returned.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from worker.bench.results.records import RequestRecord, RunResult
from worker.bench.run import cpu
from worker.bench.run.workloads import WorkItem

PAD_TOKEN_ID = 0


def run_hf_static(model_dir: Path, items: list[WorkItem], batch_size: int,
                  threads: int | None) -> RunResult:
    """Serve ``items`` with transformers, ``batch_size`` requests a batch."""
    if batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {batch_size}")
    try:
        from transformers import AutoModelForCausalLM, StoppingCriteria
    except ImportError as exc:
        raise RuntimeError("--baseline hf-static needs transformers (a dev dependency): "
                           "pip install 'conveyor[dev]' or pip install transformers") from exc
    import torch

    class StepClock(StoppingCriteria):
        """Records when each generated token of the batch is ready; never stops anything."""

        def __init__(self, start: float) -> None:
            self.start, self.times = start, []

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            self.times.append(time.perf_counter() - self.start)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.inference_mode():
            _generate(model, [WorkItem(list(range(2, 66)), 4)], StepClock(0.0), torch)  # warm-up
            start, cpu_before = time.perf_counter(), time.process_time()
            stolen_before = cpu.stolen_cpu_s()
            records = []
            for first in range(0, len(items), batch_size):
                batch = items[first:first + batch_size]
                clock = StepClock(start)
                _generate(model, batch, clock, torch)
                end = time.perf_counter() - start
                for offset, item in enumerate(batch):
                    rec = RequestRecord.for_item(first + offset, item, 0.0)
                    rec.chunks = [(t, 1) for t in clock.times[:item.max_tokens]]
                    rec.finish_s, rec.finish_reason = end, "length"
                    records.append(rec)
            duration = time.perf_counter() - start
            used = {"bench": round(time.process_time() - cpu_before, 3)}
            stolen = cpu.delta(stolen_before, cpu.stolen_cpu_s())
    finally:
        torch.set_num_threads(old_threads)
    settings = {"batch_size": batch_size, "threads": threads, "dtype": "float32",
                "padding": "left", "decoding": "greedy, EOS suppressed (min_new_tokens)"}
    return RunResult("hf-static", settings, records, duration, cpu_s=used, stolen_s=stolen,
                     notes=["transformers generate in this process; TTFT/ITL from its step "
                            "times (as if it streamed), E2E when its batch returned"])


def _generate(model: Any, batch: list[WorkItem], clock: Any, torch: Any) -> None:
    longest = max(len(i.prompt_token_ids) for i in batch)
    ids = torch.full((len(batch), longest), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, item in enumerate(batch):
        n = len(item.prompt_token_ids)
        ids[row, longest - n:] = torch.tensor(item.prompt_token_ids)
        mask[row, longest - n:] = 1
    new = max(i.max_tokens for i in batch)
    model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                   do_sample=False, stopping_criteria=[clock], pad_token_id=PAD_TOKEN_ID)
