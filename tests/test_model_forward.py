"""Our decoder against transformers' own, in float64, through the paged cache.

Checkpoints are written by transformers (tests/model_fixtures.py); both sides run
in float64 and must agree to ~1e-8 on every token's logits, whether the batch is
several whole prompts at once or chunked prefills mixed with decodes over a cache
whose unused blocks are full of NaN.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from model_fixtures import KINDS, MAX_POSITIONS, VOCAB, hf_logits, write_checkpoint
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM, PreTrainedModel

from kvstore.kv_tensors import PagedKVCache
from worker.attention import get_attention_backend, torch_backend
from worker.attention.metadata import AttentionMetadata
from worker.attention.torch_backend import TorchAttention
from worker.models import CausalLM, ModelConfig, load_model
from worker.models.rope import RotaryEmbedding

BLOCK_SIZE = 8
NUM_BLOCKS = 96
ATOL = 1e-8


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matmuls run fastest on one thread, and a busy machine cannot stall an OpenMP barrier."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, PreTrainedModel]]:
    """Every kind of checkpoint, written once: kind -> (folder, HF model in float64)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: (root / kind, write_checkpoint(kind, root / kind)) for kind in KINDS}


def new_cache(model: CausalLM, dtype: torch.dtype = torch.float64) -> PagedKVCache:
    """A cache whose every slot is NaN until written: reading one poisons the logits."""
    c = model.config
    cache = PagedKVCache(
        c.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, c.num_key_value_heads, c.head_dim, dtype
    )
    cache.fill_(float("nan"))
    return cache


def run_step(
    model: CausalLM, cache: PagedKVCache, batch: list[tuple[torch.Tensor, int, list[int]]]
) -> torch.Tensor:
    """One flat forward over (all tokens so far, tokens new this step, block table) per sequence."""
    query_lens = [n for _, n, _ in batch]
    seq_lens = [len(tokens) for tokens, _, _ in batch]
    meta = AttentionMetadata.build(query_lens, seq_lens, [t for _, _, t in batch], BLOCK_SIZE)
    input_ids = torch.cat([tokens[-n:] for tokens, n, _ in batch])
    positions = torch.cat([torch.arange(len(tokens) - n, len(tokens)) for tokens, n, _ in batch])
    with torch.no_grad():
        return model.compute_logits(model(input_ids, positions, cache, meta))


# The gathering torch backend and the paged one (the torch reference of the paged kernels).
BACKENDS = ["torch", "paged"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_ragged_batch_of_whole_prompts_matches_transformers(kind: str, backend: str,
                                                            checkpoints) -> None:
    path, hf = checkpoints[kind]
    model = load_model(path, dtype=torch.float64, attention_backend=backend)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (1, 37, 300, 2, 64, 9)]
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-len(p) // BLOCK_SIZE))] for p in prompts]
    logits = run_step(
        model, new_cache(model), [(p, len(p), t) for p, t in zip(prompts, tables, strict=True)]
    )
    for got, prompt in zip(logits.split([len(p) for p in prompts]), prompts, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=0)


@dataclass(eq=False)
class _Request:
    """A sequence fed to the model a chunk at a time; decodes are teacher-forced tokens."""

    tokens: torch.Tensor
    chunks: list[int]
    first_step: int
    blocks: list[int] = field(default_factory=list)
    done: int = 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_chunked_prefill_and_decodes_in_shuffled_blocks_match_transformers(
    kind: str, backend: str, checkpoints
) -> None:
    path, hf = checkpoints[kind]
    model = load_model(path, dtype=torch.float64, attention_backend=backend)
    gen = torch.Generator().manual_seed(2)
    rng = random.Random(3)
    specs = [  # (prompt chunks, decode steps, first step)
        ([7, 50, 43], 6, 0),
        ([64, 64, 64, 64, 44], 3, 1),
        ([1], 8, 0),
        ([20], 2, 0),  # finishes early; its blocks go to the next request, NaN-filled
        ([13, 27], 4, 4),
    ]
    requests = [
        _Request(torch.randint(0, VOCAB, (sum(c) + d,), generator=gen), c + [1] * d, first)
        for c, d, first in specs
    ]
    expected = [hf_logits(hf, r.tokens) for r in requests]
    cache = new_cache(model)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    step = 0
    while any(r.chunks for r in requests):
        active = [r for r in requests if r.chunks and r.first_step <= step]
        rng.shuffle(active)
        batch = []
        for r in active:
            n = r.chunks.pop(0)
            r.done += n
            while len(r.blocks) * BLOCK_SIZE < r.done:
                r.blocks.append(free.pop())
            batch.append((r.tokens[: r.done], n, list(r.blocks)))
        logits = run_step(model, cache, batch)
        for r, got in zip(active, logits.split([n for _, n, _ in batch]), strict=True):
            want = expected[requests.index(r)][r.done - got.shape[0] : r.done]
            torch.testing.assert_close(
                got, want, atol=ATOL, rtol=0, msg=lambda m, step=step: f"step {step}: {m}"
            )
            if not r.chunks:  # finished: its blocks are garbage now, and reused first
                cache.fill_blocks_(r.blocks, float("nan"))
                free.extend(r.blocks)
        step += 1


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), ("bfloat16", 0.1)])
def test_lower_precision_dtypes_stay_close(dtype, atol: float, checkpoints) -> None:
    path, hf = checkpoints["qwen2"]
    model = load_model(path, dtype=dtype)
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(4))
    table = list(range(0, 2 * (-(-40 // BLOCK_SIZE)), 2))  # every other block
    cache = new_cache(model, dtype=model.model.embed_tokens.weight.dtype)
    got = run_step(model, cache, [(prompt, 40, table)])
    assert got.dtype == model.model.embed_tokens.weight.dtype
    torch.testing.assert_close(got.double(), hf_logits(hf, prompt), atol=atol, rtol=0)


def test_rope_tables_equal_transformers_bit_for_bit(checkpoints) -> None:
    for kind in ("llama", "llama3_rope", "old_style_rope", "mistral"):
        path, hf = checkpoints[kind]
        config = ModelConfig.from_dir(path)
        rope = RotaryEmbedding(config.rope, config.head_dim, MAX_POSITIONS)
        positions = torch.arange(MAX_POSITIONS)
        x = torch.zeros(1, dtype=torch.float32)
        want_cos, want_sin = hf.model.rotary_emb(x, positions[None])
        cos, sin = rope.cos_sin(positions, torch.float32)
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0]), kind


def test_old_style_rope_keys_parse_like_rope_parameters(checkpoints) -> None:
    path, hf = checkpoints["old_style_rope"]
    raw = json.loads((path / "config.json").read_text())
    assert "rope_parameters" not in raw and raw["rope_scaling"]["type"] == "linear"
    new_style = {
        **raw,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0},
    }
    del new_style["rope_scaling"], new_style["rope_theta"]
    assert ModelConfig.from_dict(raw) == ModelConfig.from_dict(new_style)
    assert ModelConfig.from_dict(raw).rope.factor == 2.0
    # transformers reads the old keys the same way, so the fixture's reference stays valid.
    reloaded = LlamaForCausalLM.from_pretrained(path, dtype=torch.float64)
    prompt = torch.arange(50) % VOCAB
    torch.testing.assert_close(hf_logits(reloaded, prompt), hf_logits(hf, prompt), atol=0, rtol=0)


def test_config_reads_shapes_biases_and_eos(checkpoints) -> None:
    qwen = ModelConfig.from_dir(checkpoints["qwen2"][0])
    assert (qwen.qkv_bias, qwen.o_bias, qwen.mlp_bias, qwen.tie_word_embeddings) == (
        True,
        False,
        False,
        True,
    )
    llama = ModelConfig.from_dir(checkpoints["llama_tied_bias"][0])
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (True, True, True)
    mistral = ModelConfig.from_dir(checkpoints["mistral"][0])
    assert (mistral.head_dim, mistral.num_query_groups) == (16, 2)
    assert ModelConfig.from_dir(checkpoints["mqa"][0]).num_key_value_heads == 1
    llama3 = ModelConfig.from_dir(checkpoints["llama3_rope"][0]).rope
    assert (llama3.rope_type, llama3.original_max_position_embeddings) == ("llama3", 64)
    raw = json.loads((checkpoints["llama"][0] / "config.json").read_text())
    assert ModelConfig.from_dict(
        {**raw, "eos_token_id": [5, 2]}, {"eos_token_id": 7}
    ).eos_token_ids == [7, 5, 2]
    assert ModelConfig.from_dict(raw, {}).eos_token_ids == [2]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope type 'yarn'"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 128}, "sliding_window"),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": True,
                "sliding_window": 64,
            },
            "sliding",
        ),
    ],
)
def test_config_rejects_what_the_decoder_cannot_run(
    change: dict, message: str, checkpoints
) -> None:
    raw = json.loads((checkpoints["llama"][0] / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**raw, **change})


def test_metadata_build_maps_new_tokens_through_block_tables() -> None:
    meta = AttentionMetadata.build([3, 1], [5, 9], [[4, 1], [7, 0, 2]], block_size=4)
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    # seq 0 positions 2,3,4 -> block 4 offsets 2,3, block 1 offset 0;
    # seq 1 position 8 -> block 2 offset 0.
    assert meta.slot_mapping.tolist() == [18, 19, 4, 8]
    assert meta.block_tables.tolist() == [[4, 1, 0], [7, 0, 2]]
    assert meta.context_lens == [2, 8]
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([1], [9], [[0, 1]], block_size=4)


def test_metadata_of_decodes_only_equals_the_general_layout() -> None:
    tables = [[4, 1], [7, 0, 2], [3]]
    decodes = AttentionMetadata.build([1, 1, 1], [5, 9, 1], tables, block_size=4)
    assert decodes.query_start_loc.tolist() == [0, 1, 2, 3]
    assert decodes.positions.tolist() == [4, 8, 0]
    assert decodes.slot_mapping.tolist() == [4, 8, 12]
    # The same tokens with a prefill beside them take the general path: same slots.
    mixed = AttentionMetadata.build([1, 1, 1, 2], [5, 9, 1, 2], tables + [[6]], block_size=4)
    assert mixed.slot_mapping.tolist()[:3] == decodes.slot_mapping.tolist()
    assert mixed.positions.tolist() == [4, 8, 0, 0, 1]


def test_attention_backends_are_found_by_name_and_imported_lazily() -> None:
    assert get_attention_backend("torch") is TorchAttention
    with pytest.raises(ValueError, match="known: paged, torch"):
        get_attention_backend("no-such-backend")
    assert "flashinfer" not in sys.modules


def test_tied_head_shares_the_embedding(checkpoints) -> None:
    model = load_model(checkpoints["qwen2"][0], dtype="float32")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = load_model(checkpoints["llama"][0], dtype="torch.float32")
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def _resave_without(
    src: Path, dst: Path, drop: str, extra: dict[str, torch.Tensor] | None = None
) -> None:
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_text((src / name).read_text())
    tensors = {k: v for k, v in load_file(src / "model.safetensors").items() if k != drop}
    save_file({**tensors, **(extra or {})}, dst / "model.safetensors")


def test_loader_names_missing_unexpected_and_misshapen_tensors(checkpoints, tmp_path: Path) -> None:
    src = checkpoints["llama"][0]
    _resave_without(src, tmp_path / "missing", "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path / "missing")
    _resave_without(src, tmp_path / "extra", "", {"model.layers.9.extra": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"unexpected model\.layers\.9\.extra"):
        load_model(tmp_path / "extra")
    _resave_without(
        src, tmp_path / "shape", "model.norm.weight", {"model.norm.weight": torch.ones(31)}
    )
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(31,\)"):
        load_model(tmp_path / "shape")
    _resave_without(src, tmp_path / "untied", "lm_head.weight")
    with pytest.raises(ValueError, match=r"missing lm_head\.weight"):
        load_model(tmp_path / "untied")
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(src, dtype="int8")


def test_long_prefills_attended_in_query_tiles_give_the_same_logits(
    checkpoints, monkeypatch
) -> None:
    monkeypatch.setattr(torch_backend, "PREFILL_QUERY_TILE", 16)
    path, hf = checkpoints["mqa"]
    model = load_model(path, dtype=torch.float64)
    prompt = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(5))
    cache = new_cache(model)
    table = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - 150 // BLOCK_SIZE - 1, -1))
    first = run_step(model, cache, [(prompt[:61], 61, table[:8])])
    rest = run_step(model, cache, [(prompt, 89, table)])
    torch.testing.assert_close(torch.cat([first, rest]), hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_the_forward_stays_differentiable(checkpoints) -> None:
    """The layers overwrite buffers they just made (SiLU, the gate product, rope, the norm's
    scale): only with ops autograd can follow, so a forward under autograd still runs and
    its gradients reach the weights."""
    path, _ = checkpoints["llama"]
    model = load_model(path, dtype=torch.float64)
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(4))
    meta = AttentionMetadata.build([20], [20], [[0, 1, 2]], BLOCK_SIZE)
    with torch.enable_grad():
        logits = model.compute_logits(model(prompt, torch.arange(20), new_cache(model), meta))
        logits.logsumexp(-1).sum().backward()
    layer = model.model.layers[0]
    for weight in (layer.self_attn.q_proj.weight, layer.mlp.gate_proj.weight,
                   layer.input_layernorm.weight):
        assert weight.grad is not None and weight.grad.abs().sum() > 0
