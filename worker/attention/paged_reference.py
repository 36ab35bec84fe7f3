"""The paged attention interface, and its reference in plain torch.

Paged attention reads each sequence's keys and values where the cache holds them, through
its block table: nothing is gathered into a contiguous copy first. One call serves a whole
step, decodes and prefill chunks (with or without cached context) alike:

    paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    max_query_len, out)

- ``q`` [T, H, D]: the step's queries, sequence after sequence; sequence b owns rows
  ``query_start_loc[b]:query_start_loc[b + 1]``, the last tokens of its context.
- ``k_cache``/``v_cache`` [N, block_size, Hkv, D], already holding this step's K/V.
- ``block_tables`` [B, W]: physical blocks of each sequence, in order; entries past a
  sequence's last block are never read. ``seq_lens`` [B]: its tokens in the cache.
- Query row i of sequence b sits at position ``seq_lens[b] - q_len + i`` and attends to
  positions 0..that one (causal); query head h reads KV head h // (H / Hkv).
- A sequence with no query rows is skipped; one with rows and no context (a padded row of a
  captured decode batch) attends to nothing: its rows are zeros. ``max_query_len`` (a host
  int) bounds the rows of any one sequence, so a kernel sizes its launch without reading
  the device.
- ``out`` [T, H, D] receives the result; rows no sequence owns are left as they are.

This module's ``paged_attention`` is the reference: per sequence, the slots of its context
worked out from its table, and scaled-dot-product attention over them. It is what the
device kernels (worker/attention/paged_triton.py) are compared with, and what the paged
backend runs where they are not (the CPU). Slow by design: clear before fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_query_len: int,
                    out: torch.Tensor) -> torch.Tensor:
    """The reference of the paged interface (see the module's docstring); returns ``out``."""
    del max_query_len  # the reference reads the lengths themselves
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    flat_k = k_cache.reshape(-1, kv_heads, k_cache.shape[3])
    flat_v = v_cache.reshape(-1, kv_heads, v_cache.shape[3])
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        first, end = starts[b], starts[b + 1]
        if end == first:
            continue
        if seq_len == 0:
            out[first:end] = 0
            continue
        positions = torch.arange(seq_len, device=q.device)
        slots = block_tables[b, positions // block_size].long() * block_size \
            + positions % block_size
        keys = flat_k.index_select(0, slots).to(q.dtype).transpose(0, 1)  # [Hkv, L, D]
        values = flat_v.index_select(0, slots).to(q.dtype).transpose(0, 1)
        query_pos = torch.arange(seq_len - (end - first), seq_len, device=q.device)
        allowed = positions[None, :] <= query_pos[:, None]  # [Lq, L]
        attended = F.scaled_dot_product_attention(
            q[first:end].transpose(0, 1)[None], keys[None], values[None],
            attn_mask=allowed[None, None], scale=scale,
            enable_gqa=q.shape[1] != kv_heads)
        out[first:end] = attended[0].transpose(0, 1)
    return out
