"""Paged attention in place on a GPU: a Triton kernel of the paged interface
(worker/attention/paged_reference.py says what it computes).

One program attends a tile of one sequence's query rows for one KV head: the rows of every
query head that reads that KV head stacked together (grouped-query attention reads each
K/V tile once for its whole group), walking the sequence's context a tile of keys at a
time. Each key's slot is found through the block table (no gathered copy), and softmax is
taken online (running max and sum) in float32 (float64 for float64). Keys past the
sequence's length are never loaded (a free slot may hold NaN); keys after a row's own
position are masked.

The launch depends only on the number of sequences, the longest query and the shapes, not
on any value on the device: a CUDA graph of a decode step can replay it.

Imported only where the "paged" backend runs on CUDA, or by the tests under Triton's
interpreter (TRITON_INTERPRET=1, set before triton is imported), which runs it on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Query rows (tokens x the query heads of one KV head) a program attends at once: enough
# for tl.dot's smallest tile on a GPU (16) in a decode, where a sequence has one token;
# more in a prefill chunk, whose rows share each K/V tile they load.
DECODE_ROWS = 16
PREFILL_ROWS = 64
# Keys a program scores at once: a few cache blocks of 16.
KEY_TILE = 64


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, starts_ptr, lens_ptr, scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_tb,
    BLOCK_SIZE: tl.constexpr, GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, TOKENS: tl.constexpr,
    KEYS: tl.constexpr, IEEE: tl.constexpr, ACC: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(2)
    q_start = tl.load(starts_ptr + seq)
    q_len = tl.load(starts_ptr + seq + 1) - q_start
    seq_len = tl.load(lens_ptr + seq)
    first = tl.program_id(1) * TOKENS
    context = seq_len - q_len

    rows = tl.arange(0, TOKENS * GROUPS_P2)
    token = first + rows // GROUPS_P2
    head = kv_head * GROUPS + rows % GROUPS_P2
    row_ok = (token < q_len) & (rows % GROUPS_P2 < GROUPS)
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
                + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    query_pos = context + token

    # Keys up to the tile's last row's position; none where the tile has no rows.
    end = tl.minimum(context + first + TOKENS, seq_len)
    end = tl.where(first < q_len, end, 0)
    best = tl.full([TOKENS * GROUPS_P2], float("-inf"), ACC)
    total = tl.zeros([TOKENS * GROUPS_P2], ACC)
    acc = tl.zeros([TOKENS * GROUPS_P2, HEAD_DIM_P2], ACC)
    for key_start in range(0, end, KEYS):
        keys = key_start + tl.arange(0, KEYS)
        key_ok = keys < end
        block = tl.load(tables_ptr + seq * stride_tb + keys // BLOCK_SIZE, mask=key_ok,
                        other=0).to(tl.int64)
        offset = keys % BLOCK_SIZE
        tile_ok = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks
                    + kv_head * stride_kh + dims[None, :], mask=tile_ok, other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k.to(q.dtype)))
        allowed = key_ok[None, :] & (keys[None, :] <= query_pos[:, None])
        scores = tl.where(allowed, scores * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        # A row with nothing allowed yet keeps -inf; subtracting 0 keeps exp() at 0, not NaN.
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        p = tl.exp(scores - shift[:, None])
        kept = tl.exp(best - shift)
        total = total * kept + tl.sum(p, 1)
        v = tl.load(v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs
                    + kv_head * stride_vh + dims[None, :], mask=tile_ok, other=0.0)
        if IEEE:
            acc = acc * kept[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * kept[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        best = new_best
    acc = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh
             + dims[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_query_len: int,
                    out: torch.Tensor) -> torch.Tensor:
    """The paged interface (worker/attention/paged_reference.py) by the Triton kernel;
    returns ``out``. Float32 queries are multiplied in full precision (no TF32): the
    engine's float32 greedy tokens are compared with transformers'."""
    num_seqs, heads, head_dim = block_tables.shape[0], q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")
    constants = launch_constants(q.dtype, heads, kv_heads, head_dim, k_cache.shape[1],
                                 max_query_len)
    grid = (num_seqs, triton.cdiv(max_query_len, constants["TOKENS"]), kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0),
        out.stride(1), block_tables.stride(0), **constants)
    return out


def launch_constants(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                     block_size: int, max_query_len: int) -> dict[str, object]:
    """The kernel's compile-time constants for a step of these shapes (one compiled kernel
    each: decode steps share one, prefill steps another)."""
    groups = heads // kv_heads
    groups_p2 = triton.next_power_of_2(groups)
    rows = DECODE_ROWS if max_query_len == 1 else PREFILL_ROWS
    return dict(
        BLOCK_SIZE=block_size, GROUPS=groups, GROUPS_P2=groups_p2, HEAD_DIM=head_dim,
        HEAD_DIM_P2=max(16, triton.next_power_of_2(head_dim)),
        TOKENS=max(1, rows // groups_p2), KEYS=KEY_TILE, IEEE=dtype == torch.float32,
        # (float64's products are float64: its running sums must be too)
        ACC=tl.float64 if dtype == torch.float64 else tl.float32)
