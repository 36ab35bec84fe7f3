"""A decode-only step's layers in one native call (worker/models/native_decode.py) against the
Python layers: the same logits and the same cache writes for every kind of checkpoint
(biases, tied heads, grouped and single kv heads, llama3 rope), over shuffled blocks whose
free slots are NaN; float32 CPU steps take it, all-decode or small ones with prefill chunks."""

from __future__ import annotations

import pytest
import torch
from decode_fixtures import BLOCK_SIZE, NUM_BLOCKS, cache_for, decode_step, prefilled
from kernel_fixtures import needs_kernel
from model_fixtures import KINDS, VOCAB, write_checkpoint

import worker.host.cpu_kernels as kernel_loader
from kvstore.kv_tensors import PagedKVCache
from producer.settings import CPU_DECODE_LAYERS, CPU_MATMUL
from worker.attention.metadata import AttentionMetadata
from worker.host.cpu_kernels import cpu_kernels, decode_layers_kernel
from worker.models import load_model, native_decode
from worker.models.linear import linear

ENV_SWITCH = CPU_DECODE_LAYERS.name
MATMUL_SWITCH = CPU_MATMUL.name

kernel = decode_layers_kernel()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("checkpoints")
    for kind in KINDS:
        write_checkpoint(kind, root / kind)
    return root


@needs_kernel
@pytest.mark.parametrize("kind, batch", [(kind, 6) for kind in KINDS]
                         # Unpacked, past SKINNY_MAX_ROWS the step's matmuls are oneDNN's.
                         + [("llama_tied_bias", 40), ("qwen2", 40)])
# The step's matmuls on packed copies of the weights (the default), or without them.
@pytest.mark.parametrize("matmul", ["", "unpacked"])
def test_native_decode_steps_match_the_python_layers(kind, batch, matmul, checkpoints,
                                                     monkeypatch):
    monkeypatch.setenv(MATMUL_SWITCH, matmul)
    model = load_model(checkpoints / kind, dtype=torch.float32)
    lens = ([1, 7, 8, 9, 40, 100] * 7)[:batch]
    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(ENV_SWITCH, switch)
        seqs, tables, cache = prefilled(model, lens, seed=5)
        before = model.num_native_steps
        logits = []
        for step in range(4):  # teacher-forced next tokens, the same on both paths
            for i, s in enumerate(seqs):
                s.append((i * 31 + step * 7) % VOCAB)
            logits.append(decode_step(model, cache, seqs, tables, [1] * len(seqs)))
        assert model.num_native_steps - before == (4 if switch == "1" else 0)
        if switch == "1":  # the packed copies were there for the native step, or not made
            assert bool(native_decode._packed_projections(model, native_decode._gathered(model))) \
                == (matmul == "")
        results[switch] = (torch.stack(logits), cache)
    (native, native_cache), (python, python_cache) = results["1"], results["0"]
    assert not native.isnan().any()
    torch.testing.assert_close(native, python, rtol=1e-4, atol=1e-4)
    for got, want in zip((*native_cache.k, *native_cache.v), (*python_cache.k, *python_cache.v),
                         strict=True):
        # Written slots agree; slots nobody wrote are still NaN on both sides.
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
# With two threads: the step team's region (packed weights) or a region per loop (unpacked).
@pytest.mark.parametrize("matmul", ["", "unpacked"])
def test_the_native_forward_ends_with_the_final_norm(kind, matmul, checkpoints, monkeypatch):
    """Without the LM head (a forward's hidden states) the native step ends with the final
    norm, as the Python layers do."""
    monkeypatch.setenv(MATMUL_SWITCH, matmul)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = load_model(checkpoints / kind, dtype=torch.float32)
        hidden = {}
        for switch in ("0", "1"):
            monkeypatch.setenv(ENV_SWITCH, switch)
            seqs, tables, cache = prefilled(model, [3, 9, 17], seed=4)
            meta = AttentionMetadata.build([1, 1, 1], [len(s) for s in seqs], tables,
                                           BLOCK_SIZE)
            meta.positions = torch.tensor([len(s) - 1 for s in seqs])
            before = model.num_native_steps
            with torch.inference_mode():
                hidden[switch] = model(torch.tensor([s[-1] for s in seqs]), meta.positions,
                                       cache, meta)
            assert model.num_native_steps - before == int(switch)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(hidden["1"], hidden["0"], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
# With one thread, or two: the step team's region (packed weights, with take-overs of a
# late partner's tasks) or a region per loop (unpacked).
@pytest.mark.parametrize("threads, matmul", [(1, ""), (2, ""), (2, "unpacked")])
def test_steps_with_prefill_chunks_take_the_native_path_and_match_the_python_layers(
        kind, threads, matmul, checkpoints, monkeypatch):
    """A prompt's first chunk, later chunks beside decodes, chunks whose tokens attend to
    each other in the same step: each token is a row of the kernel's over its sequence's
    table, and its K/V is in the cache before any token attends."""
    monkeypatch.setenv(MATMUL_SWITCH, matmul)
    before_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native, native_cache, python, python_cache = _mixed_steps_both_ways(
            kind, checkpoints, monkeypatch)
    finally:
        torch.set_num_threads(before_threads)
    assert not native.isnan().any()
    torch.testing.assert_close(native, python, rtol=1e-4, atol=1e-4)
    for got, want in zip((*native_cache.k, *native_cache.v), (*python_cache.k, *python_cache.v),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


def _mixed_steps_both_ways(kind, checkpoints, monkeypatch):
    """Logits and caches of steps with prefill chunks, native and on the Python layers."""
    model = load_model(checkpoints / kind, dtype=torch.float32)
    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(ENV_SWITCH, switch)
        before = model.num_native_steps
        seqs, tables, cache = prefilled(model, [5, 12, 1, 30], seed=3)  # whole prompts
        logits = []
        for step, new in enumerate(([1, 2, 1, 2], [1, 1, 2, 1], [1, 1, 1, 1])):
            for i, s in enumerate(seqs):
                s += [(i * 31 + step * 7 + j) % VOCAB for j in range(new[i])]
            logits.append(decode_step(model, cache, seqs, tables, new))
        assert model.num_native_steps - before == (4 if switch == "1" else 0)
        results[switch] = (torch.cat(logits), cache)
    return (*results["1"], *results["0"])


@needs_kernel
def test_steps_past_the_mixed_size_or_in_float64_take_the_python_layers(checkpoints,
                                                                        monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "1")
    monkeypatch.setattr(native_decode, "MAX_MIXED_TOKENS", 8)
    model = load_model(checkpoints / "llama", dtype=torch.float32)
    seqs, tables, cache = prefilled(model, [5, 12], seed=1)
    assert model.num_native_steps == 0  # the prefill itself: 17 tokens
    seqs[0].append(3)
    seqs[1] += [4, 5]
    decode_step(model, cache, seqs, tables, [1, 2])  # 3 tokens, one a chunk's
    assert model.num_native_steps == 1
    wide = load_model(checkpoints / "llama", dtype=torch.float64)
    c = wide.config
    cache64 = PagedKVCache(c.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, c.num_key_value_heads,
                           c.head_dim, torch.float64)
    decode_step(wide, cache64, [[1, 2, 3]], [[0]], [3])
    decode_step(wide, cache64, [[1, 2, 3, 4]], [[0]], [1])
    assert wide.num_native_steps == 0


@needs_kernel
def test_the_native_step_refuses_a_slot_outside_the_cache(checkpoints, monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "1")
    model = load_model(checkpoints / "llama", dtype=torch.float32)
    seqs, tables, cache = prefilled(model, [5], seed=2)
    seqs[0].append(1)
    meta = AttentionMetadata.build([1], [6], tables, BLOCK_SIZE)
    meta.positions = torch.tensor([5])
    meta.slot_mapping = torch.tensor([NUM_BLOCKS * 4 * BLOCK_SIZE])
    with pytest.raises(RuntimeError, match="slot outside the cache"), torch.inference_mode():
        model(torch.tensor([1]), meta.positions, cache, meta)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 24, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_the_skinny_matmul_equals_the_blas(rows, bias):
    # 37 output rows (9 tiles of 4 and a tail of 1), 70 inputs (4 vectors and a tail of 6).
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 70, generator=gen)
    w = torch.randn(37, 70, generator=gen)
    b = torch.randn(37, generator=gen) if bias else torch.empty(0)
    got = cpu_kernels().skinny_linear(x, w, b)
    want = torch.nn.functional.linear(x, w, b if bias else None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_every_projection_and_the_lm_head_take_the_kernels_matmul(checkpoints, monkeypatch):
    """The Python layers' matmuls (prefill, mixed steps) and the LM head's are the kernels'
    ``linear``, as the native step's are; ``CONVEYOR_CPU_MATMUL=blas`` keeps them on
    ``F.linear``."""
    model = load_model(checkpoints / "llama", dtype=torch.float32)
    module, calls = cpu_kernels(), []

    class Spy:
        def __getattr__(self, name):
            return getattr(module, name)

        def linear(self, *args):
            calls.append(args[0].shape[0])
            return module.linear(*args)

    spy = Spy()
    monkeypatch.setattr(kernel_loader, "cpu_kernels", lambda: spy)
    monkeypatch.setattr(native_decode, "MAX_MIXED_TOKENS", 0)  # the prefill: Python layers
    seqs = [torch.randint(0, VOCAB, (n,)).tolist() for n in (5, 30)]
    cache = cache_for(model)
    tables = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    decode_step(model, cache, seqs, tables, [5, 30])
    layers = model.config.num_hidden_layers
    # q k v o gate up down per layer, then the head (over every token _step feeds)
    assert calls == [35] * (7 * layers + 1)
    calls.clear()
    monkeypatch.setenv(MATMUL_SWITCH, "blas")
    decode_step(model, cache, seqs, tables, [5, 30])
    assert calls == []


@needs_kernel
@pytest.mark.parametrize("rows", [1, 12, 13, 64, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernels_matmul_equals_the_blas_to_rounding(rows, bias, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(70, 96, generator=gen)
    b = torch.randn(70, generator=gen) if bias else None
    want = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(linear(x, w, b), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x.view(1, rows, 96), w, b), want[None], rtol=1e-5,
                               atol=1e-5)
    monkeypatch.setenv(MATMUL_SWITCH, "blas")
    assert torch.equal(linear(x, w, b), want)


@needs_kernel
@pytest.mark.parametrize("rows", [4, 40])
def test_the_kernels_matmul_takes_strided_and_expanded_biases(rows):
    x, w = torch.randn(rows, 64), torch.randn(48, 64)
    for bias in (torch.randn(96)[::2], torch.tensor(0.5).expand(48)):
        torch.testing.assert_close(linear(x, w, bias), torch.nn.functional.linear(x, w, bias),
                                   rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_matmul_autograd_must_see_stays_differentiable():
    w = torch.randn(48, 64, requires_grad=True)
    linear(torch.randn(40, 64), w).sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape


@needs_kernel
def test_onednn_is_found_where_torch_has_it():
    # Past SKINNY_MAX_ROWS the matmuls are oneDNN's; a build that lost the op would fall back to
    # the BLAS without a word.
    assert cpu_kernels().HAS_ONEDNN_LINEAR == torch.backends.mkldnn.is_available()


@needs_kernel
def test_a_fused_weights_packed_copy_is_made_again_when_any_of_its_parameters_is_written(
        checkpoints, monkeypatch):
    monkeypatch.delenv(MATMUL_SWITCH, raising=False)
    model = load_model(checkpoints / "llama", dtype=torch.float32)
    native_decode.prepare(model)
    weights = native_decode._gathered(model)
    qkv_before, o_before = native_decode._packed_projections(model, weights)[:2]
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)  # not the first of q/k/v: its own version counter moves
    qkv_after, o_after = native_decode._packed_projections(model, weights)[:2]
    assert qkv_after is not qkv_before and o_after is o_before
    fused = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    x = torch.randn(3, fused.shape[1])
    torch.testing.assert_close(linear(x, weights[1], packed=qkv_after), x @ fused.T,
                               rtol=1e-5, atol=1e-5)
