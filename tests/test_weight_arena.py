"""The loader lays a CPU model's parameters out in one buffer (worker/models/weight_arena.py):
q/k/v and gate/up back to back, so each group is one matrix by a view, with no copy; the
values and the state dict are the checkpoint's."""

from __future__ import annotations

import pytest
import torch
from kernel_fixtures import needs_kernel
from model_fixtures import write_checkpoint
from safetensors.torch import load_file

from kvstore.kv_tensors import PagedKVCache
from producer.settings import CPU_DECODE_LAYERS
from worker.attention.metadata import AttentionMetadata
from worker.models import load_model
from worker.models.weight_arena import joined

ENV_SWITCH = CPU_DECODE_LAYERS.name


@pytest.fixture(scope="module")
def biased(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("arena") / "llama_tied_bias"
    write_checkpoint("llama_tied_bias", path)
    return path


def test_every_parameter_holds_the_checkpoint_and_lives_in_one_buffer(biased):
    model = load_model(biased, dtype=torch.float32)
    saved = load_file(biased / "model.safetensors")
    state = model.state_dict()
    assert set(saved) - {"lm_head.weight"} <= set(state)
    for name, tensor in saved.items():
        torch.testing.assert_close(state[name], tensor.float(), rtol=0, atol=0)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_qkv_and_gate_up_join_as_views_without_a_copy(biased):
    model = load_model(biased, dtype=torch.float32)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            weight = joined([p.weight for p in group])
            bias = joined([p.bias for p in group])
            assert weight is not None and bias is not None
            assert weight.data_ptr() == group[0].weight.data_ptr()  # a view, not a copy
            torch.testing.assert_close(weight, torch.cat([p.weight for p in group]),
                                       rtol=0, atol=0)
            torch.testing.assert_close(bias, torch.cat([p.bias for p in group]), rtol=0, atol=0)
            with torch.no_grad():  # writes through: the same memory
                group[-1].weight[-1, -1] += 1.0
            assert weight[-1, -1] == group[-1].weight[-1, -1]


def test_tensors_apart_do_not_join():
    a, b = torch.zeros(2, 4), torch.zeros(3, 4)
    assert joined([a, b]) is None
    whole = torch.zeros(10, 4)
    assert joined([whole[:2], whole[3:5]]) is None  # a gap between them
    assert joined([whole[:2], whole[2:5]]).shape == (5, 4)


def _prefill_and_decode(model) -> torch.Tensor:
    """Prefill tokens 1, 2, 3 into a fresh cache, then decode token 4 (two steps, both of
    the native path's kind: a small prefill and a decode); the decode's logits."""
    c = model.config
    cache = PagedKVCache(c.num_hidden_layers, 8, 8, c.num_key_value_heads, c.head_dim,
                         torch.float32)
    meta = AttentionMetadata.build([3], [3], [[0]], 8)
    meta.positions = torch.arange(3)
    with torch.inference_mode():
        model(torch.tensor([1, 2, 3]), meta.positions, cache, meta)
        meta = AttentionMetadata.build([1], [4], [[0]], 8)
        meta.positions = torch.tensor([3])
        return model.compute_logits(model(torch.tensor([4]), meta.positions, cache, meta))


@needs_kernel
def test_a_model_whose_projections_lie_apart_takes_the_python_layers(biased, monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "1")
    model = load_model(biased, dtype=torch.float32)
    native = _prefill_and_decode(model)
    assert model.num_native_steps == 2
    apart = load_model(biased, dtype=torch.float32)
    with torch.no_grad():  # k's weight moved to memory of its own: q/k/v no longer join
        k = apart.model.layers[0].self_attn.k_proj
        k.weight.data = k.weight.detach().clone()
    torch.testing.assert_close(_prefill_and_decode(apart), native, rtol=1e-4, atol=1e-4)
    assert apart.num_native_steps == 0


@needs_kernel
def test_a_model_cast_after_its_first_native_step_gathers_its_weights_again(biased,
                                                                            monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "1")
    model = load_model(biased, dtype=torch.float32)
    before = _prefill_and_decode(model)
    assert model.num_native_steps == 2
    model.double().float()  # new memory for every parameter, the same values
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.mul_(2.0)
    after = _prefill_and_decode(model)
    # Its projections no longer join (no arena): the Python layers ran, on the new weights.
    assert model.num_native_steps == 2
    assert not torch.allclose(after, before, rtol=1e-4, atol=1e-4)
