"""The transformers baselines, on the device and in the dtype the engine would take ("auto":
CUDA in bfloat16 where there is one, else the CPU in float32):

- `hf-static`: `generate` in static, left-padded batches. Every request is there at t=0 and
  batches go in workload order. A batch decodes until its longest request is done (greedy,
  EOS suppressed), so only each request's own max_tokens count as useful tokens.
  `generate` does not stream: the step times recorded (a stopping criterion sees every
  step) give TTFT and ITL as if it did, which flatters it; E2E is when its batch returned.
- `hf-cb`: transformers' own continuous batching (the manager behind `generate_batch`),
  every request there at t=0 with its own max_tokens (greedy, EOS off), its tokens' times
  as the manager records them. A transformers without it says so.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore import blocks_for
from worker.bench.results.limits import sync
from worker.bench.results.records import RequestRecord, RunResult
from worker.bench.run import cpu
from worker.bench.run.workloads import WorkItem

PAD_TOKEN_ID = 0
# hf-cb's KV pages on a CPU, where transformers would otherwise size its pool from the
# machine's memory (minutes of zeroing here): what the workload's sequences need at once.
CB_PAGE_SIZE = 16
# What each baseline serves once before it is timed (kernels chosen, caches made).
WARM_UP = [WorkItem(list(range(2, 66)), 4)]


def _model(model_dir: Path, name: str) -> tuple[Any, Any]:
    """transformers' model of ``model_dir`` on the engine's "auto" device and dtype, and
    torch."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise RuntimeError(f"--baseline {name} needs transformers (a dev dependency): "
                           "pip install 'conveyor[dev]' or pip install transformers") from exc
    import torch

    from worker.host.device import engine_device, engine_dtype

    device = engine_device("auto")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=engine_dtype("auto", device))
    return model.to(device).eval(), torch


def _timed(name: str, threads: int | None,
           run: Callable[[Any, Any, Callable[[], float], Callable[[], None]],
                         tuple[list, dict]],
           model_dir: Path, settings: dict[str, Any], notes: list[str]) -> RunResult:
    """``run(model, torch, begin, end)`` -> (records, extra settings), timed from its call of
    ``begin()`` (after its warm-up; it returns the start on ``time.perf_counter``'s clock)
    to its call of ``end()`` (before any shutdown; else its return), its CPU counted over
    the same span. The model's device memory is given back after."""
    from worker.engine.memory import release_device_memory

    model, torch = _model(model_dir, name)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    marks: dict[str, float] = {}

    def begin() -> float:
        marks.update(cpu=time.process_time(), stolen=cpu.stolen_cpu_s(),
                     start=time.perf_counter())
        return marks["start"]

    def end() -> None:
        marks.update(end=time.perf_counter(), cpu_end=time.process_time(),
                     stolen_end=cpu.stolen_cpu_s())

    try:
        with torch.inference_mode():
            records, extra = run(model, torch, begin, end)
        if "end" not in marks:
            end()
        duration = marks["end"] - marks["start"]
        used = {"bench": round(marks["cpu_end"] - marks["cpu"], 3)}
        stolen = cpu.delta(marks["stolen"], marks["stolen_end"])
        settings = {**settings, **extra, "threads": threads, "device": str(model.device),
                    "dtype": str(model.dtype).removeprefix("torch.")}
    finally:
        torch.set_num_threads(old_threads)
        del model  # (then its memory, before the next system sizes its own)
        release_device_memory()
    return RunResult(name, settings, records, duration, cpu_s=used, stolen_s=stolen,
                     notes=notes)


def run_hf_static(model_dir: Path, items: list[WorkItem], batch_size: int,
                  threads: int | None) -> RunResult:
    """Serve ``items`` with transformers' generate, ``batch_size`` requests a batch."""
    if batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {batch_size}")

    def run(model: Any, torch: Any, begin: Callable[[], float], end: Callable[[], None]
            ) -> tuple[list, dict]:
        _generate(model, WARM_UP, torch, time.perf_counter())
        start = begin()
        records = []
        for first in range(0, len(items), batch_size):
            batch = items[first:first + batch_size]
            times = _generate(model, batch, torch, start)
            returned = time.perf_counter() - start
            for offset, item in enumerate(batch):
                rec = RequestRecord.for_item(first + offset, item, 0.0)
                rec.chunks = [(t, 1) for t in times[:item.max_tokens]]
                rec.finish_s, rec.finish_reason = returned, "length"
                records.append(rec)
        return records, {}

    return _timed("hf-static", threads, run, model_dir,
                  {"batch_size": batch_size, "padding": "left",
                   "decoding": "greedy, EOS suppressed (min_new_tokens)"},
                  ["transformers generate in this process; TTFT/ITL from its step times (as "
                   "if it streamed), E2E when its batch returned"])


def _generate(model: Any, batch: list[WorkItem], torch: Any, start: float) -> list[float]:
    """One static batch; returns when each step's tokens were ready, from ``start``."""
    from transformers import StoppingCriteria

    class StepClock(StoppingCriteria):
        """Records when each generated token of the batch is ready; never stops anything."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            sync(input_ids.device)  # (the step's token exists once the device made it)
            self.times.append(time.perf_counter() - start)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    longest = max(len(i.prompt_token_ids) for i in batch)
    ids = torch.full((len(batch), longest), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, item in enumerate(batch):
        n = len(item.prompt_token_ids)
        ids[row, longest - n:] = torch.tensor(item.prompt_token_ids)
        mask[row, longest - n:] = 1
    new = max(i.max_tokens for i in batch)
    clock = StepClock()
    model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                   max_new_tokens=new, min_new_tokens=new, do_sample=False,
                   stopping_criteria=[clock], pad_token_id=PAD_TOKEN_ID)
    sync(model.device)
    return clock.times


def has_continuous_batching() -> bool:
    """Whether the installed transformers has continuous batching (generate_batch)."""
    try:
        from transformers import GenerationMixin
    except ImportError:
        return False
    return hasattr(GenerationMixin, "init_continuous_batching")


def run_hf_continuous(model_dir: Path, items: list[WorkItem], threads: int | None,
                      timeout_s: float) -> RunResult:
    """Serve ``items`` with transformers' continuous batching, all submitted at t=0; a
    RuntimeError past ``timeout_s``."""

    def run(model: Any, torch: Any, begin: Callable[[], float], end: Callable[[], None]
            ) -> tuple[list, dict]:
        manager, extra = _manager(model, items)
        if hasattr(manager, "warmup"):  # as generate_batch does: its graphs made first
            manager.warmup()
        manager.start()
        try:
            _serve(manager, WARM_UP, time.perf_counter(), timeout_s)
            records = _serve(manager, items, begin(), timeout_s)
            end()  # (not its shutdown)
        finally:
            manager.stop(block=True)
        return records, extra

    return _timed("hf-cb", threads, run, model_dir,
                  {"decoding": "greedy, EOS off, each request its own max_tokens"},
                  ["transformers' continuous batching (generate_batch's manager) in this "
                   "process; TTFT/ITL from the times it records for each token"])


def _manager(model: Any, items: list[WorkItem]) -> tuple[Any, dict[str, Any]]:
    """transformers' continuous batching manager for ``items`` (greedy, no EOS), or a
    RuntimeError where this transformers has none."""
    import transformers
    from transformers import GenerationConfig

    if not has_continuous_batching():
        raise RuntimeError(f"--baseline hf-cb: transformers {transformers.__version__} has no "
                           "continuous batching (generate_batch)")
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD_TOKEN_ID,
                              max_new_tokens=max(i.max_tokens for i in items))
    kwargs: dict[str, Any] = {"generation_config": config}
    extra: dict[str, Any] = {"transformers": transformers.__version__}
    if model.device.type == "cpu":
        # Every sequence's pages at once (sized from memory it would take minutes here).
        pages = sum(blocks_for(len(i.prompt_token_ids) + i.max_tokens, CB_PAGE_SIZE) + 1
                    for i in items) + 64
        extra["num_blocks"] = pages
        params = inspect.signature(model.init_continuous_batching).parameters
        if "continuous_batching_config" in params:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            fields = inspect.signature(ContinuousBatchingConfig).parameters
            size = "page_size" if "page_size" in fields else "block_size"  # (5.17 renamed it)
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
                num_blocks=pages, **{size: CB_PAGE_SIZE})
        else:  # older transformers read it from the generation config
            config.num_blocks, config.block_size = pages, CB_PAGE_SIZE
    return model.init_continuous_batching(**kwargs), extra


def _serve(manager: Any, items: list[WorkItem], start: float, timeout_s: float
           ) -> list[RequestRecord]:
    """Submit ``items`` to a started manager; their records once all are finished."""
    timestamps = "record_timestamps" in inspect.signature(manager.add_request).parameters
    extra = {"record_timestamps": True} if timestamps else {}
    for index, item in enumerate(items):
        taken = manager.add_request(list(item.prompt_token_ids), request_id=f"r{index}",
                                    max_new_tokens=item.max_tokens, **extra)
        if taken is None:
            raise RuntimeError(f"transformers' continuous batching did not take request {index}")
    records: dict[int, RequestRecord] = {}
    while len(records) < len(items):
        if time.perf_counter() - start > timeout_s:
            raise RuntimeError(f"transformers' continuous batching finished {len(records)} of "
                               f"{len(items)} requests in {timeout_s:g} s (--timeout)")
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before every "
                                   "request finished")
            continue
        if not result.is_finished():
            continue
        index = int(result.request_id.removeprefix("r"))
        now = time.perf_counter() - start
        rec = RequestRecord.for_item(index, items[index], 0.0)
        tokens = result.generated_tokens[:items[index].max_tokens]
        times = [t - start for t in (getattr(result, "timestamps", None) or [])]
        rec.chunks = ([(t, 1) for t in times[:len(tokens)]] if len(times) >= len(tokens)
                      else [(now, len(tokens))])
        rec.finish_s, rec.finish_reason = now, "length"
        if result.error is not None:
            rec.error = str(result.error)
        records[index] = rec
    return [records[i] for i in range(len(items))]
