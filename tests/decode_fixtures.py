"""Decode steps on a model's layers in the tests: a paged cache whose free slots are NaN,
sequences prefilled into shuffled blocks, and one step's logits."""

from __future__ import annotations

import torch
from model_fixtures import VOCAB

from kvstore.kv_tensors import PagedKVCache
from worker.attention.metadata import AttentionMetadata
from worker.models import CausalLM

BLOCK_SIZE = 8
NUM_BLOCKS = 64


def cache_for(model: CausalLM) -> PagedKVCache:
    c = model.config
    cache = PagedKVCache(c.num_hidden_layers, NUM_BLOCKS * 4, BLOCK_SIZE, c.num_key_value_heads,
                         c.head_dim, torch.float32)
    cache.fill_(float("nan"))
    return cache


def decode_step(model: CausalLM, cache: PagedKVCache, seqs: list[list[int]],
                tables: list[list[int]], new: list[int]) -> torch.Tensor:
    """Feed the last ``new[i]`` tokens of each sequence; the logits of every fed token (for a
    decode-only step on the native path, its LM head's in the same call as its layers)."""
    meta = AttentionMetadata.build(new, [len(s) for s in seqs], tables, BLOCK_SIZE)
    ids = torch.tensor([t for s, n in zip(seqs, new, strict=True) for t in s[-n:]])
    positions = torch.tensor([p for s, n in zip(seqs, new, strict=True)
                              for p in range(len(s) - n, len(s))])
    meta.positions = positions
    with torch.inference_mode():
        return model.logits(ids, positions, cache, meta)


def prefilled(model: CausalLM, lens: list[int], seed: int):
    """Sequences of ``lens`` tokens prefilled into shuffled blocks (room for 4 more tokens)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]
    order = torch.randperm(NUM_BLOCKS * 4, generator=gen).tolist()
    tables = []
    for n in lens:
        need = -(-(n + 4) // BLOCK_SIZE)
        tables.append([order.pop() for _ in range(need)])
    cache = cache_for(model)
    decode_step(model, cache, seqs, tables, lens)
    return seqs, tables, cache
