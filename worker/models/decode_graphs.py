"""Decode steps replayed from CUDA graphs: one launch where the layers issue hundreds.

A decode step of a real model is hundreds of kernel launches from Python (~440 a step for
the 32M-parameter model: 7.4-9.5 ms of host time around 1.1-1.5 ms of GPU work, docs/gpu.md).
At engine start each batch-size bucket's step (embeddings, the decoder layers through the
paged attention backend, the final norm and the LM head) is captured once as a CUDA graph
over static buffers; a decode step then copies its inputs into those buffers and replays
the graph of the smallest bucket that holds it.

Static-buffer discipline: the graph reads only these buffers, so a step writes them all
(its rows) before the replay, and the rows past its batch up to the bucket are padding:
length 0 (the kernel reads no block for them and writes zeros) and K/V written to the
cache's spare block (kvstore/kv_tensors.py), which no sequence owns. Block tables
are as wide as the longest sequence the engine admits; entries past a sequence's blocks
are never read. What differs between requests (penalties, logit bias, grammar masks,
sampling) stays outside the graph: the sampler works on the logits the replay leaves.

On the CPU nothing is captured: the same buffers are filled and the same layers run
eagerly (``capture=False``), so the suite checks the discipline that makes a replay right.
"""

from __future__ import annotations

import gc
import time

import structlog
import torch

from kvstore import blocks_for
from kvstore.kv_tensors import PagedKVCache
from worker.attention.metadata import AttentionMetadata

log = structlog.get_logger(__name__)

# The largest batch captured: steps with more rows run eagerly (their launches are spread
# over more work). The graphs' memory is the largest bucket's activations and logits.
MAX_GRAPH_BATCH = 256


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 16 up to ``max_batch`` (and
    ``max_batch`` itself): a step of B rows pads to the next, at most 15 rows."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


class DecodeGraphs:
    """Decode steps of up to ``max_batch`` rows, replayed from captured CUDA graphs (or, with
    ``capture=False``, run eagerly over the same static buffers)."""

    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device,
                 max_batch: int, max_model_len: int, capture: bool = True) -> None:
        if kv_cache.k[0].shape[0] <= kv_cache.num_blocks:
            raise ValueError("decode graphs need a spare cache block for their padded rows")
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.buckets = batch_buckets(max_batch)
        rows, block_size = self.buckets[-1], kv_cache.block_size
        width = blocks_for(max_model_len, block_size)
        # The spare block's first slot: where padded rows write their K/V.
        self.spare_slot = kv_cache.num_blocks * block_size

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.seq_lens = zeros(rows), zeros(rows), zeros(rows)
        self.slot_mapping = zeros(rows).fill_(self.spare_slot)
        self.block_tables = zeros(rows, width)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int64, device=device)
        # Every bucket's logits are rows of this one buffer: a graph's output stays
        # allocated for its replays, and one each would hold the sum of the buckets' rows.
        weight = model.lm_head.weight
        self.logits = torch.empty(rows, weight.shape[0], dtype=weight.dtype, device=device)
        self.metas = {b: self._meta(b) for b in self.buckets}
        # Bucket -> (graph, its logits); empty where nothing is captured.
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory_bytes = 0
        self.capture_seconds = 0.0
        self.replays = 0
        if capture:
            self._capture()

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _meta(self, rows: int) -> AttentionMetadata:
        """The metadata a bucket's graph reads: views of the static buffers. The host-side
        lists are the bucket's shape only (one token a row): the paged backend reads the
        lengths on the device."""
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[:rows + 1], seq_lens=self.seq_lens[:rows],
            block_tables=self.block_tables[:rows], slot_mapping=self.slot_mapping[:rows],
            block_size=self.kv_cache.block_size, query_lens=[1] * rows,
            seq_lens_list=[1] * rows, positions=self.positions[:rows],
            input_ids=self.input_ids[:rows])
        meta.backend_plans["paged"] = 1  # the longest query: one token
        return meta

    def _forward(self, rows: int) -> torch.Tensor:
        """A bucket's decode step over the static buffers: the Python layers (what is
        captured; the CPU's native step does not take padded rows) and the LM head, into
        the logits buffer's first ``rows``."""
        meta, model = self.metas[rows], self.model
        hidden = model.decoder_layers(model.model.embed_tokens(meta.input_ids), meta.positions,
                                      self.kv_cache, meta)
        return torch.mm(hidden, model.lm_head.weight.t(), out=self.logits[:rows])

    @torch.inference_mode()
    def _capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool (a smaller bucket's
        graph reuses the larger's memory). Each runs once eagerly first, on a side stream:
        kernels compile and libraries make their workspaces outside the capture."""
        start = time.perf_counter()
        # A collection during a capture could free another engine's graphs or buffers
        # while the device records: collect first, none until done.
        gc.collect()
        gc.disable()
        try:
            free_before = torch.cuda.mem_get_info(self.device)[0]
            pool = torch.cuda.graph_pool_handle()
            current = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)  # one: a library workspace each stream
            for rows in reversed(self.buckets):
                side.wait_stream(current)
                with torch.cuda.stream(side):
                    self._forward(rows)
                current.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(rows)
                self.graphs[rows] = (graph, logits)
            torch.cuda.synchronize(self.device)
        finally:
            gc.enable()
        # The graphs' pool, and the static buffers they read and write.
        buffers = (self.input_ids, self.positions, self.seq_lens, self.slot_mapping,
                   self.block_tables, self.query_start_loc, self.logits)
        self.memory_bytes = (max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
                             + sum(t.numel() * t.element_size() for t in buffers))
        self.capture_seconds = time.perf_counter() - start
        log.info("decode steps captured in CUDA graphs", buckets=len(self.buckets),
                 max_batch=self.max_batch, gib=round(self.memory_bytes / 2**30, 3),
                 seconds=round(self.capture_seconds, 2))

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket that holds ``rows`` (None past the largest)."""
        return next((b for b in self.buckets if b >= rows), None)

    def run(self, meta: AttentionMetadata) -> torch.Tensor:
        """The logits ``[B, vocab]`` of a decode step (every row one token; B at most
        ``max_batch``): its inputs copied into the static buffers, its bucket replayed."""
        rows = len(meta.query_lens)
        bucket = self.bucket(rows)
        assert bucket is not None and meta.num_tokens == rows, "not a decode step that fits"
        self.input_ids[:rows].copy_(meta.input_ids)
        self.positions[:rows].copy_(meta.positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.seq_lens[:rows].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:rows, :width].copy_(meta.block_tables)
        # Padding: no context, K/V to the spare block (what the last step left there may
        # be a real row's).
        self.seq_lens[rows:bucket].zero_()
        self.slot_mapping[rows:bucket].fill_(self.spare_slot)
        self.replays += 1
        if bucket in self.graphs:
            graph, logits = self.graphs[bucket]
            graph.replay()
            return logits[:rows]
        return self._forward(bucket)[:rows]

    def stats(self) -> dict[str, int | float]:
        return {"cuda_graph_buckets": len(self.graphs),
                "cuda_graph_memory_bytes": self.memory_bytes,
                "cuda_graph_replays": self.replays}
