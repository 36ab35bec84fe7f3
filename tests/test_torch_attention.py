"""The torch attention backend's prefill paths: a sequence's first chunk attends to its own
rows under the fused causal mask, a later chunk gathers its context from the paged cache
under an explicit mask; both give the attention a plain softmax gives, free cache slots
full of NaN never leak in, and one step may mix them with decodes."""

from __future__ import annotations

import pytest
import torch

from worker.attention import torch_backend
from worker.attention.metadata import AttentionMetadata
from worker.attention.torch_backend import TorchAttention
from worker.host.step_upload import StepUpload

HEADS, KV_HEADS, DIM, BLOCK = 8, 2, 64, 16
# (tokens this step, tokens in the context after it): a first chunk, a later chunk, a decode.
SEQUENCES = [(130, 130), (20, 60), (1, 17)]


def _step(dtype: torch.dtype, seed: int = 0):
    """A paged cache full of NaN but where earlier steps wrote, and this step's q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    blocks = 32
    k_cache = torch.full((blocks, BLOCK, KV_HEADS, DIM), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(blocks, generator=gen).tolist()
    tables, taken = [], 0
    for _, n in SEQUENCES:
        need = -(-n // BLOCK)
        tables.append(order[taken:taken + need])
        taken += need
    context = []  # every position's K/V, cached before the step or brought by it
    for (_, n), table in zip(SEQUENCES, tables, strict=True):
        k = torch.randn(n, KV_HEADS, DIM, generator=gen, dtype=dtype)
        v = torch.randn(n, KV_HEADS, DIM, generator=gen, dtype=dtype)
        context.append((k, v))
        for p in range(n):
            k_cache[table[p // BLOCK], p % BLOCK] = k[p]
            v_cache[table[p // BLOCK], p % BLOCK] = v[p]
    new = [(k[n - q:], v[n - q:]) for (k, v), (q, n) in zip(context, SEQUENCES, strict=True)]
    q = torch.randn(sum(q for q, _ in SEQUENCES), HEADS, DIM, generator=gen, dtype=dtype)
    k_new = torch.cat([k for k, _ in new])
    v_new = torch.cat([v for _, v in new])
    meta = AttentionMetadata.build([q for q, _ in SEQUENCES], [n for _, n in SEQUENCES],
                                   tables, block_size=BLOCK)
    return q, k_new, v_new, k_cache, v_cache, meta, context


def _softmax_attention(q: torch.Tensor, context: list, scale: float) -> torch.Tensor:
    """Plain float64 attention, each query over its own causal context."""
    out, row = [], 0
    for (k, v), (n_new, n) in zip(context, SEQUENCES, strict=True):
        k, v = k.double().repeat_interleave(HEADS // KV_HEADS, 1), v.double().repeat_interleave(
            HEADS // KV_HEADS, 1)
        for i in range(n_new):
            pos = n - n_new + i
            scores = torch.einsum("hd,khd->hk", q[row].double(), k[:pos + 1]) * scale
            out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v[:pos + 1]))
            row += 1
    return torch.stack(out).reshape(row, HEADS * DIM)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_first_chunks_attend_to_their_own_rows_and_later_chunks_to_the_cache(
        dtype, tol, monkeypatch) -> None:
    attn = TorchAttention(HEADS, KV_HEADS, DIM, DIM**-0.5)
    first_chunks = []
    own_rows = TorchAttention._first_chunk
    monkeypatch.setattr(TorchAttention, "_first_chunk",
                        lambda self, q, k, v, prefill, out: (
                            first_chunks.append(prefill.end - prefill.start),
                            own_rows(self, q, k, v, prefill, out)))

    q, k_new, v_new, k_cache, v_cache, meta, context = _step(dtype)
    fused = attn.forward(q, k_new, v_new, k_cache, v_cache, meta)
    assert first_chunks == [130]  # only the sequence with nothing cached took its own rows
    plan = meta.backend_plans[torch_backend._PLAN_KEY]
    # Its plan holds no cache slots: nothing of it is gathered.
    assert [p.end - p.start for p in plan.prefills if p.slots is None] == [130]
    assert all(p.slots is not None for p in plan.prefills if p.end - p.start != 130)

    # The same step with query tiles shorter than the first chunk: every prefill gathers
    # its context from the cache and attends under an explicit mask.
    monkeypatch.setattr(torch_backend, "PREFILL_QUERY_TILE", 64)
    q, k_new, v_new, k_cache, v_cache, meta, context = _step(dtype)
    gathered = attn.forward(q, k_new, v_new, k_cache, v_cache, meta)
    assert first_chunks == [130]

    expected = _softmax_attention(q, context, DIM**-0.5).to(dtype)
    assert not fused.isnan().any()
    torch.testing.assert_close(fused, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(gathered, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lq", [1, 7, None])
def test_attention_by_kv_head_equals_the_grouped_query_mode(dtype, lq):
    """The path a CUDA step takes (its kernel that takes a mask has no grouped-query mode):
    masked, each KV head's queries stacked along the query axis, row by row under each row's
    own mask; causal (``lq`` None: a first chunk), the KV heads repeated. Both equal the fused
    call's grouped-query mode, on the head-major strided views ``_attend`` passes."""
    gen = torch.Generator().manual_seed(lq or 0)
    batch, lk = 3, 40
    rows = lk if lq is None else lq

    def head_major(n: int, heads: int) -> torch.Tensor:  # [B, heads, n, D] over [B, n, heads, D]
        return torch.randn(batch, n, heads, DIM, generator=gen, dtype=dtype).transpose(1, 2)

    q, k, v = head_major(rows, HEADS), head_major(lk, KV_HEADS), head_major(lk, KV_HEADS)
    allowed = None
    if lq is not None:
        allowed = torch.rand(batch, lq, lk, generator=gen) < 0.7
        allowed[..., 0] = True  # every row attends to something
    scale = DIM ** -0.5
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=None if allowed is None else allowed[:, None],
        is_causal=allowed is None, scale=scale, enable_gqa=True)
    got = torch_backend.attend_by_kv_head(q, k, v, allowed, scale)
    assert got.shape == want.shape == (batch, HEADS, rows, DIM)
    torch.testing.assert_close(got, want)


def test_a_steps_plan_takes_its_host_indices_to_the_device_in_one_copy(monkeypatch):
    """Decodes in two length groups and two prefills (one gathering its context): the plan
    lays every index it makes on the host out first and moves them in one call (on CUDA a
    copy per small tensor is a synchronous transfer each), and attends as plain softmax."""
    import sys

    monkeypatch.setattr(sys.modules[__name__], "SEQUENCES",
                        [(130, 130), (20, 60), (1, 17), (1, 20), (1, 90)])
    monkeypatch.setattr(torch_backend, "_decode_kernel", lambda q, flat_k: None)  # torch path
    monkeypatch.setattr(torch_backend, "DECODE_GROUP_MIN", 1)
    copies = []

    class CountedUpload(StepUpload):
        """Packs on the CPU as on a device, and counts what each send moves."""

        def __init__(self, device):
            super().__init__(device, pack=True)

        def send(self):
            copies.append(len(self._parts))
            super().send()

    monkeypatch.setattr(torch_backend, "StepUpload", CountedUpload)
    attn = TorchAttention(HEADS, KV_HEADS, DIM, DIM**-0.5)
    q, k_new, v_new, k_cache, v_cache, meta, context = _step(torch.float64)
    out = attn.forward(q, k_new, v_new, k_cache, v_cache, meta)
    attn.forward(q, k_new, v_new, k_cache, v_cache, meta)  # a second layer: the same plan
    plan = meta.backend_plans[torch_backend._PLAN_KEY]
    assert [g.tokens.tolist() for g in plan.decodes] == [[150, 151], [152]]
    assert [p.slots is not None for p in plan.prefills] == [False, True]
    # Prefill rows and lengths, then rows, lengths and tokens of each decode group.
    assert copies == [2 + 3 * 2]
    expected = _softmax_attention(q, context, DIM**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_a_plan_staged_with_the_steps_inputs_attends_as_one_made_by_the_first_layer(
        monkeypatch):
    """On a device the runner stages the plan's host half in the step's one upload
    (TorchAttention.stage); the first layer finishes it. Packed on the CPU here, it gives the
    plan and the output of the one the first layer makes on its own."""
    import sys

    monkeypatch.setattr(sys.modules[__name__], "SEQUENCES",
                        [(130, 130), (20, 60), (1, 17), (1, 20), (1, 90)])
    monkeypatch.setattr(torch_backend, "_decode_kernel", lambda q, flat_k: None)
    monkeypatch.setattr(torch_backend, "DECODE_GROUP_MIN", 1)
    attn = TorchAttention(HEADS, KV_HEADS, DIM, DIM**-0.5)
    q, k_new, v_new, k_cache, v_cache, meta, context = _step(torch.float64)
    assert TorchAttention.stage(meta.query_lens, meta.seq_lens_list, StepUpload("cpu")) == {}
    upload = StepUpload("cpu", pack=True)
    staged = TorchAttention.stage(meta.query_lens, meta.seq_lens_list, upload)
    upload.send()
    assert upload.sent and len(staged) == 1
    meta.backend_plans.update(staged)
    out = attn.forward(q, k_new, v_new, k_cache, v_cache, meta)
    plan = meta.backend_plans[torch_backend._PLAN_KEY]
    assert isinstance(plan, torch_backend._StepPlan) and len(plan.decodes) == 2
    _, _, _, k_cache2, v_cache2, meta2, _ = _step(torch.float64)
    alone = attn.forward(q, k_new, v_new, k_cache2, v_cache2, meta2)
    assert torch.equal(out, alone)
    expected = _softmax_attention(q, context, DIM**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
