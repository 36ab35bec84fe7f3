"""Engine settings: every knob of the offline engine, with its default and meaning. No torch."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any

from scheduler.config import SchedulerConfig, check_preemption_mode
from worker.host.device import DTYPE_NAMES


@dataclass(frozen=True)
class EngineConfig:
    """How an Engine lays out memory and batches work."""

    # Token slots per KV block.
    block_size: int = 16
    # Device KV pool size in blocks; None sizes it from kv_cache_memory_gib.
    num_kv_blocks: int | None = None
    # Memory for the device KV pool when num_kv_blocks is None (capped at what max_num_seqs
    # full-length sequences can use). A small fixed pool, not a share of RAM: on a CPU the
    # KV cache shares memory with everything else.
    kv_cache_memory_gib: float = 0.5
    # On CUDA, when num_kv_blocks is None: the share of the GPU's memory the engine may hold
    # (weights, a step's activations, KV); the KV pool takes what the rest leaves
    # (worker/engine/memory.py), so a real model runs a real batch without a flag.
    gpu_memory_utilization: float = 0.9
    # Host swap tier in blocks; None sizes it from swap_space_gib (0 turns swapping off).
    swap_blocks: int | None = None
    # Host memory for swapped-out KV when swap_blocks is None (pinned on CUDA).
    swap_space_gib: float = 0.5
    # Settings the scheduler owns take its defaults (scheduler/config.py says why each).
    # "auto" (swap when the host has room and it beats recomputing), "swap", "recompute".
    preemption_mode: str = SchedulerConfig.preemption_mode
    # Share the KV of identical full prompt blocks between requests.
    enable_prefix_caching: bool = True
    # Token budget of one step (prefill chunks plus one per decode).
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    # Requests running at once.
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    # Cap on one request's prefill chunk in a step; None means the whole budget.
    max_prefill_chunk: int | None = SchedulerConfig.max_prefill_chunk
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    # Inter-token target (ms) that sizes each step's prefill while requests decode; None/0 off.
    itl_target_ms: float | None = SchedulerConfig.itl_target_ms
    # Longest prompt + output; None means the model's max_position_embeddings.
    max_model_len: int | None = None
    # "auto": float32 on CPU, bfloat16 on CUDA; or float32, float64, bfloat16, float16.
    dtype: str = "auto"
    # "auto": cuda when available, else cpu.
    device: str = "auto"
    # Attention backend by name ("torch", "paged"; "auto": "paged" on CUDA where triton is
    # installed, else "torch": worker/attention/__init__.py).
    attention_backend: str = "auto"
    # Never capture decode steps in CUDA graphs (worker/models/decode_graphs.py): every step
    # runs its layers' kernels one launch at a time. Graphs are captured only on CUDA, with
    # the paged attention backend (what "auto" picks there).
    enforce_eager: bool = False
    # torch intra-op threads for this process; None leaves torch's default.
    num_threads: int | None = None
    # On a CPU, keep large allocations in glibc's heap instead of fresh mmaps (which cost a
    # page fault per 4 KiB every step): worker/host/allocator.py. Process-wide.
    tune_host_allocator: bool = True
    # Detokenize and apply stop strings in the engine. The fleet worker turns this off and
    # does both on its publisher thread, off the engine loop.
    detokenize: bool = True
    # Hand out KV blocks in a scrambled order (tests use it to prove order never matters).
    block_shuffle_seed: int | None = None
    # Overlapped steps: schedule step N+1 while step N runs on a runner thread
    # (worker/engine/step_pipeline.py). None: on for CUDA, where the device would otherwise wait
    # for the host between steps; off on a CPU, where the host work and the forward share
    # the same cores (docs/benchmarks.md measures both).
    async_scheduling: bool | None = None
    # A simulated engine (worker/engine/simulated.py): no forward, steps that take this many
    # ms (its cost's fixed part alone) or follow this cost (a preset's name or a JSON file).
    # Never a default: an instrument for testing the fleet at a GPU's speed.
    simulate_step_ms: float | None = None
    simulate_cost: str | None = None

    @property
    def simulated(self) -> bool:
        return self.simulate_step_ms is not None or self.simulate_cost is not None

    @classmethod
    def from_kwargs(cls, values: dict[str, Any]) -> EngineConfig:
        """Build from keyword arguments, rejecting unknown ones with a ValueError."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown engine setting(s): {', '.join(unknown)}")
        return cls(**values)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's settings for an engine whose requests are at most ``max_model_len``
        tokens long."""
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_prefill_chunk=self.max_prefill_chunk,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_model_len=max_model_len,
            preemption_mode=self.preemption_mode,
            itl_target_ms=self.itl_target_ms,
        )

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.swap_blocks is not None and self.swap_blocks < 0:
            raise ValueError(f"swap_blocks must be >= 0, got {self.swap_blocks}")
        check_preemption_mode(self.preemption_mode)
        if self.simulate_step_ms is not None and self.simulate_cost is not None:
            raise ValueError("give simulate_step_ms or simulate_cost, not both")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPE_NAMES)}, got "
                             f"{self.dtype!r}")



def field_default(cls: type, name: str) -> Any:
    """The default of one config dataclass field: the CLI's flags use and show these."""
    default = next(f.default for f in fields(cls) if f.name == name)
    if default is MISSING:
        raise ValueError(f"{cls.__name__}.{name} has no plain default")
    return default
