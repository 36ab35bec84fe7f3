"""This machine's limits, measured in the run, and the physical limit of a workload.

Peaks drift by tens of percent between runs on a shared machine, so a throughput means
something only as a fraction of limits measured right before it, in the same process and
at the same thread count. They are measured again right after the runs, and the better of
each pair sets the limit: on a VM the 5 tries of one measurement (~0.3 s) can all land in a
moment when the host gives the two CPUs half their speed (GEMM 154-157 against 240-306
GFLOP/s in alternate invocations here), and a limit set there puts a run above 1.0 of it.

- GEMM peak: the best of 5 ``torch.mm`` of two 2048 x 2048 float32 matrices (2 * 2048^3
  FLOP each);
- copy bandwidth: the best of 5 copies of a buffer the size of the model's weights
  (bytes of the buffer per second).

Where the engine runs on a GPU (CUDA, "auto"'s choice there), its limits are the GPU's, in
the engine's dtype (bfloat16): the GEMM of two 8192 x 8192 matrices, and a device-to-device
copy of the weights' bytes counted read and written (a copy moves both; a decode step's
weight reads are reads alone), each timed after the device finished it.

The physical limit of a workload served in one pass (all requests at t=0), in seconds:

    2 * (W - H) * prompt tokens / GEMM peak      every prompt token through every layer
  + 2 * W * output tokens / GEMM peak            every output token, LM head included
  + longest output * W bytes / copy bandwidth    each decode step reads the weights once

where W is the number of weights that take part in matmuls (every layer's projections
plus the LM head; the embedding table is a lookup) and H the LM head's. The workload's
output tokens divided by that time is the fastest it could possibly be served here.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GEMM_N = 2048
# A GPU's GEMM peak: a matmul of this size fills its tensor cores (the CPU's does not fit).
GPU_GEMM_N = 8192
REPEATS = 5


@dataclass(frozen=True)
class Peaks:
    gemm_flops: float  # FLOP/s
    copy_bytes_per_s: float
    threads: int

    def best(self, other: Peaks) -> Peaks:
        """Each peak at the better of the two measurements (at the same thread count)."""
        assert other.threads == self.threads, "peaks at different thread counts"
        return Peaks(max(self.gemm_flops, other.gemm_flops),
                     max(self.copy_bytes_per_s, other.copy_bytes_per_s), self.threads)

    def as_dict(self) -> dict[str, float]:
        return {"gemm_gflops": round(self.gemm_flops / 1e9, 1),
                "copy_gb_per_s": round(self.copy_bytes_per_s / 1e9, 2),
                "threads": self.threads}


def measure_peaks(threads: int, weight_bytes: int, device: str = "cpu") -> Peaks:
    """GEMM peak and copy bandwidth at ``threads`` torch threads (restored afterwards), or
    of the GPU where ``device`` is "cuda"."""
    import torch

    if device == "cuda":
        return _gpu_peaks(threads, weight_bytes)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(GEMM_N, GEMM_N, device="cpu")
        b = torch.randn(GEMM_N, GEMM_N, device="cpu")
        gemm = best_seconds(lambda: torch.mm(a, b))
        src = torch.empty(max(1, weight_bytes // 4), dtype=torch.float32, device="cpu")
        src.fill_(1.0)
        dst = torch.empty_like(src)
        dst.copy_(src)  # touch every page before timing
        copy = best_seconds(lambda: dst.copy_(src))
    finally:
        torch.set_num_threads(before)
    return Peaks(2 * GEMM_N**3 / gemm, src.numel() * 4 / copy, threads)


def _gpu_peaks(threads: int, weight_bytes: int) -> Peaks:
    """The GPU's bfloat16 GEMM peak and its copy bandwidth (bytes read and written)."""
    import torch

    cuda = torch.device("cuda")
    peaks = Peaks(gemm_peak(cuda, torch.bfloat16, GPU_GEMM_N),
                  copy_bandwidth(cuda, weight_bytes), threads)
    torch.cuda.empty_cache()  # (their buffers, before an engine sizes its KV pool)
    return peaks


def sync(device: torch.device) -> None:
    """Wait for what ``device`` was given to do (nothing to wait for on a CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_on(device: torch.device, fn) -> float:
    """The least seconds of REPEATS calls of ``fn``, each waited for on the device
    (whatever ran before it, too)."""
    def waited() -> None:
        fn()
        sync(device)

    sync(device)
    return best_seconds(waited)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes a second a device-to-device copy moves (read and written), best of a few."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_on(device, lambda: dst.copy_(src))


def gemm_peak(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP a second of the best n x n x n matmul of a few (after one to warm up)."""
    import torch

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)
    return 2 * n**3 / best_on(device, lambda: torch.matmul(a, b))


def best_seconds(fn) -> float:
    """The least seconds of REPEATS calls of ``fn`` (one that waits for its own work)."""
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass(frozen=True)
class ModelSize:
    matmul_weights: int  # W
    lm_head_weights: int  # H
    bytes_per_weight: int = 4  # float32; bfloat16 on a GPU: 2

    @property
    def weight_bytes(self) -> int:
        return self.matmul_weights * self.bytes_per_weight


def model_size(config: dict[str, Any], bytes_per_weight: int = 4) -> ModelSize:
    """W and H from a Hugging Face config.json (Llama-family layout), each weight
    ``bytes_per_weight`` bytes (the engine's dtype)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
    mlp = 3 * hidden * inter  # gate, up, down
    head = config["vocab_size"] * hidden
    return ModelSize(config["num_hidden_layers"] * (attention + mlp) + head, head,
                     bytes_per_weight)


def physical_limit_s(size: ModelSize, peaks: Peaks, prompt_tokens: int, output_tokens: int,
                     longest_output: int) -> dict[str, float]:
    """The limit's three terms and their sum, in seconds (see the module's docstring)."""
    w, h = size.matmul_weights, size.lm_head_weights
    prefill = 2 * (w - h) * prompt_tokens / peaks.gemm_flops
    decode = 2 * w * output_tokens / peaks.gemm_flops
    reads = longest_output * size.weight_bytes / peaks.copy_bytes_per_s
    return {"prefill_flops_s": prefill, "output_flops_s": decode, "weight_reads_s": reads,
            "total_s": prefill + decode + reads}


def limit_report(config: dict[str, Any], peaks: Peaks, workload: dict[str, Any],
                 measured: list[Peaks] | None = None, device: str = "cpu") -> dict[str, Any]:
    """What results.json keeps: the device, the peaks (and each measurement they are the
    best of), the model's sizes and the workload's limit."""
    size = model_size(config, weight_bytes_on(device))
    limit = physical_limit_s(size, peaks, workload["prompt_tokens"], workload["output_tokens"],
                             workload["max_output"])
    return {"device": device, "peaks": peaks.as_dict(),
            "measured": [p.as_dict() for p in measured or [peaks]],
            "model": asdict(size),
            "limit_s": {k: round(v, 4) for k, v in limit.items()},
            "limit_output_tokens_per_s": round(workload["output_tokens"] / limit["total_s"], 1)}


def limits_device(simulated: bool) -> str:
    """Where the bench's engines run, so where its limits are measured: "cuda" where the
    engine's "auto" device is (and the engines are real), else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() and not simulated else "cpu"


def weight_bytes_on(device: str) -> int:
    """A weight's bytes in the engine's "auto" dtype there (bfloat16 on CUDA, float32 else:
    worker.host.device.engine_dtype)."""
    import torch

    from worker.host.device import engine_dtype

    return engine_dtype("auto", torch.device(device)).itemsize
