"""An engine's place: the device and precision it runs in, set up for it (process-wide
settings made before its model loads), its model, and the KV memory it lays out there."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from kvstore import BlockPool, KVCacheManager, blocks_for
from kvstore.kv_tensors import PagedKVCache
from worker.attention.paged_backend import PagedAttention
from worker.attention.torch_backend import keep_cudnn_attention_off
from worker.engine.config import EngineConfig
from worker.host.allocator import keep_large_allocations_in_heap
from worker.host.device import engine_device, engine_dtype
from worker.models import native_decode
from worker.models.config import ModelConfig
from worker.models.decode_graphs import MAX_GRAPH_BATCH, DecodeGraphs
from worker.models.loader import load_model

if TYPE_CHECKING:
    from worker.models.llama import CausalLM

# KV tokens a simulated engine holds unless told (num_kv_blocks): about what an H200 keeps for
# an 8B model beside its weights (~120 GB at 128 KiB a token), and max_num_seqs sequences of
# full length for the models and batches of the benchmarks (256 x 4,096).
SIMULATED_KV_TOKENS = 2**20

log = structlog.get_logger(__name__)


def prepare_device(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The engine's device and dtype, and the process-wide settings for them, made before
    its model loads."""
    device = engine_device(config.device)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    if device.type == "cpu" and config.tune_host_allocator:
        keep_large_allocations_in_heap()
    if device.type == "cuda":
        keep_cudnn_attention_off()  # a plan per shape: 12x the decode step (its docstring)
    if device.type == "cpu":
        # The CPU kernels now, not mid-step; where not built yet, the torch path for this
        # process's life while they build in the background.
        from worker.host.cpu_kernels import engine_kernels

        engine_kernels()
    return device, engine_dtype(config.dtype, device)


def load_forward(config: EngineConfig, model_dir: str | Path, simulated: bool,
                 ) -> tuple[torch.device, torch.dtype, CausalLM | None, ModelConfig]:
    """The engine's device, dtype, model (its weights loaded and prepared) and the model's
    config; a simulated engine's is config.json alone: no model, the CPU, and the dtype a
    GPU would have ("auto": bfloat16), which sizes its block pool as it would there."""
    if simulated:
        dtype = engine_dtype(config.dtype, torch.device("cuda"))
        return torch.device("cpu"), dtype, None, ModelConfig.from_dir(model_dir)
    device, dtype = prepare_device(config)
    model = load_model(model_dir, dtype, device, config.attention_backend)
    if device.type == "cpu":
        native_decode.prepare(model)  # the packed weights, now, not mid-step
    return device, dtype, model, model.config


@dataclass
class KVMemory:
    """An engine's KV: the device pool, and the host tier preempted requests swap to."""

    cache: PagedKVCache | None  # None: a simulated engine's (accounting without tensors)
    pool: BlockPool
    # None: no swapping (recompute preemption, or no host memory given to it).
    host_cache: PagedKVCache | None
    host_pool: BlockPool | None
    # The block tables, prefix cache and swap bookkeeping over both pools.
    manager: KVCacheManager
    # Bytes of the device pool, and the GPU memory share it was sized from (None: not so).
    pool_bytes: int = 0
    gpu_memory_utilization: float | None = None
    # Decode steps captured in CUDA graphs over this cache (None: every step eager).
    graphs: DecodeGraphs | None = None

    def stats(self) -> dict[str, int | float]:
        """Gauges of both pools now, and prefix cache evictions since start."""
        host = self.host_pool
        sized = ({} if self.gpu_memory_utilization is None
                 else {"gpu_memory_utilization": self.gpu_memory_utilization})
        return {
            **sized, **(self.graphs.stats() if self.graphs is not None else {}),
            "kv_pool_bytes": self.pool_bytes,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_cached": self.pool.num_cached,
            "host_blocks_total": host.num_blocks if host else 0,
            "host_blocks_used": host.num_used if host else 0,
            "prefix_cache_evictions": self.pool.num_evictions,
        }


# Rows the sampler and prompt logprobs work on at least (prompt logprobs go 256 at a time).
MIN_LOGIT_ROWS = 256
# Bytes a logit takes in a step's sampling at most: the logits, their float32 copy, scaled by
# temperature, softmax, top-p's sorted copy and its indices (~26 measured by reading).
LOGIT_BYTES = 28
# The torch backend's CUDA decode step gathers one layer's K and V of its batch into
# contiguous buffers (worker/attention/torch_backend.py) of up to ~1.5 layers' share of the
# pool: each block of the pool needs that much more beside. The paged backend gathers none.
GATHER_SHARE = 1.5


def step_activation_bytes(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """A bound on a step's transient memory besides the K/V gather (GATHER_SHARE): the token
    budget's widest tensors in the model's dtype (activation_width), and the sampler's work
    on every row's logits (LOGIT_BYTES each, for at least MIN_LOGIT_ROWS rows)."""
    rows = max(config.max_num_seqs, MIN_LOGIT_ROWS)
    return (config.max_num_batched_tokens * activation_width(model) * dtype.itemsize
            + rows * model.vocab_size * LOGIT_BYTES)


def activation_width(model: ModelConfig) -> int:
    """Values a token's widest tensors of a step hold at once: the MLP's gate and up outputs
    and their product, q, k, v, attention's output and the residual stream twice."""
    kv_width = 2 * model.num_key_value_heads * model.head_dim
    q_width = model.num_attention_heads * model.head_dim
    return 3 * model.intermediate_size + 2 * q_width + kv_width + 2 * model.hidden_size


def decode_graph_bytes(model: ModelConfig, dtype: torch.dtype, rows: int) -> int:
    """A bound on the decode graphs' memory: the largest bucket's activations (the buckets
    share one pool) and the one logits buffer they all write."""
    return rows * (activation_width(model) + model.vocab_size) * dtype.itemsize


def decode_graph_rows(config: EngineConfig, device: torch.device,
                      model: CausalLM | None) -> int:
    """The largest decode batch to capture in CUDA graphs: 0 (none) but on CUDA with the
    paged backend (the torch backend's launches depend on the step's lengths) and without
    enforce_eager."""
    if (model is None or device.type != "cuda" or config.enforce_eager
            or model.attention_backend is not PagedAttention):
        return 0
    return min(config.max_num_seqs, MAX_GRAPH_BATCH)


def gather_share(model: CausalLM | None, num_layers: int) -> float:
    """What a pool block costs besides itself in the decode step's K/V gather, as a share
    of it: GATHER_SHARE of a layer's for the torch backend, none for the paged one."""
    if model is not None and model.attention_backend is PagedAttention:
        return 0.0
    return GATHER_SHARE / num_layers


def cuda_kv_blocks(config: EngineConfig, per_block: int, useful: int, reserve: int,
                   memory_info: Callable[[], tuple[int, int]], share: float) -> int:
    """Device KV blocks on a GPU when num_kv_blocks is not given: what the GPU has free now
    (the weights loaded), less the share left to others (1 - gpu_memory_utilization of its
    memory) and a step's activations and the decode graphs (``reserve``), each block with
    ``share`` of itself more for the decode step's K/V gather (gather_share), at most
    ``useful``; at least 1. ``memory_info``: (free, total) bytes, torch.cuda.mem_get_info."""
    free, total = memory_info()
    budget = free - int((1 - config.gpu_memory_utilization) * total) - reserve
    per_block = int(per_block * (1 + share))
    if budget < per_block:
        raise MemoryError(
            f"no GPU memory left for the KV cache: {free / 2**30:.1f} of {total / 2**30:.1f} "
            f"GiB free, {(1 - config.gpu_memory_utilization) * total / 2**30:.1f} left to "
            f"others (gpu_memory_utilization {config.gpu_memory_utilization}) and "
            f"{reserve / 2**30:.1f} for a step's activations and decode graphs: raise "
            "gpu_memory_utilization, set enforce_eager, "
            "lower max_num_batched_tokens or max_num_seqs, or give num_kv_blocks")
    return max(1, min(budget // per_block, useful))


def capture_decode_graphs(model: CausalLM, cache: PagedKVCache, device: torch.device,
                          rows: int, max_model_len: int) -> DecodeGraphs | None:
    """The decode graphs over ``cache``; where the capture fails, a warning that says why
    and None: the engine serves with every step launched eagerly (as with enforce_eager)
    rather than not at all."""
    try:
        return DecodeGraphs(model, cache, device, rows, max_model_len)
    except Exception as exc:  # noqa: BLE001 - whatever stopped the capture, serve eagerly
        log.warning("decode steps not captured in CUDA graphs: they run eagerly",
                    error=f"{type(exc).__name__}: {exc}")
    # (out of the except block: its traceback held the half-made graphs' buffers)
    release_device_memory()
    return None


def release_device_memory() -> None:
    """Give the GPU the memory nothing refers to any more: reference cycles collected (an
    overlapped engine sits in one), then torch's cache emptied, so that the next engine, in
    this process or another, sizes its KV pool from what is really free. No-op without CUDA."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def kv_memory(config: EngineConfig, model: ModelConfig, device: torch.device,
              dtype: torch.dtype, max_model_len: int, tensors_too: bool = True,
              memory_info: Callable[[], tuple[int, int]] | None = None,
              forward: CausalLM | None = None) -> KVMemory:
    """Lay out the KV pools ``config`` asks for (sized from memory where not in blocks: on
    a GPU from its free memory, ``memory_info`` telling it, elsewhere kv_cache_memory_gib);
    without ``tensors_too`` only their accounting (a simulated engine's). With the model
    (``forward``) on CUDA, its decode steps are captured in graphs over the pool
    (decode_graph_rows), whose memory the pool leaves them."""
    def tensors(num_blocks: int, on: torch.device, pin: bool = False,
                untouched: bool = False, spare: int = 0) -> PagedKVCache:
        return PagedKVCache(model.num_hidden_layers, num_blocks, config.block_size,
                            model.num_key_value_heads, model.head_dim, dtype, on, pin,
                            untouched, spare)

    graph_rows = decode_graph_rows(config, device, forward) if tensors_too else 0

    per_block = PagedKVCache.bytes_per_block(model.num_hidden_layers, config.block_size,
                                             model.num_key_value_heads, model.head_dim, dtype)
    # No more than max_num_seqs full-length sequences use.
    useful = config.max_num_seqs * blocks_for(max_model_len, config.block_size)
    num_blocks = config.num_kv_blocks or max(
        1, min(int(config.kv_cache_memory_gib * 2**30) // per_block, useful))
    utilization = None
    if tensors_too and config.num_kv_blocks is None and device.type == "cuda":
        reserve = (step_activation_bytes(config, model, dtype)
                   + decode_graph_bytes(model, dtype, graph_rows))
        if memory_info is None:
            # What an engine freed before this one still sits in torch's cache, counted as
            # used: give it back first.
            torch.cuda.empty_cache()
        num_blocks = cuda_kv_blocks(config, per_block, useful, reserve,
                                    memory_info or (lambda: torch.cuda.mem_get_info(device)),
                                    gather_share(forward, model.num_hidden_layers))
        utilization = config.gpu_memory_utilization
        log.info("KV pool sized from the GPU's free memory", blocks=num_blocks,
                 gib=round(num_blocks * per_block / 2**30, 2),
                 gpu_memory_utilization=utilization,
                 activations_gib=round(reserve / 2**30, 2))
    if not tensors_too and config.num_kv_blocks is None:
        # A simulated engine's blocks are accounting only: by default it has a GPU's memory
        # (num_kv_blocks sets a smaller pool, to study preemption).
        num_blocks = min(useful, SIMULATED_KV_TOKENS // config.block_size)
    swap_blocks = (config.swap_blocks if config.swap_blocks is not None
                   else int(config.swap_space_gib * 2**30) // per_block)
    if config.preemption_mode == "recompute":
        swap_blocks = 0
    pool = BlockPool(num_blocks, shuffle_seed=config.block_shuffle_seed)
    host_pool = BlockPool(swap_blocks) if swap_blocks else None
    manager = KVCacheManager(pool, config.block_size, host_pool=host_pool,
                             enable_prefix_caching=config.enable_prefix_caching,
                             watermark_blocks=max(1, num_blocks // 100))
    # A block is swapped in only after it was swapped out: the swap tier's memory can come
    # as it is first written (pinned memory for a GPU is touched when it is made anyway).
    if not tensors_too:
        return KVMemory(None, pool, None, host_pool, manager, num_blocks * per_block)
    host_cache = (tensors(swap_blocks, torch.device("cpu"), pin=device.type == "cuda",
                          untouched=True) if swap_blocks else None)
    # One spare block past the pool's: where a decode graph's padded rows write.
    cache = tensors(num_blocks, device, spare=1)
    graphs = (capture_decode_graphs(forward, cache, device, graph_rows, max_model_len)
              if graph_rows and forward is not None else None)
    return KVMemory(cache, pool, host_cache, host_pool, manager, num_blocks * per_block,
                    utilization, graphs)
