"""make_model writes small, deterministic checkpoints that transformers reads as intended."""

from __future__ import annotations

import ast
import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from worker.modelgen import ARCHS, LLAMA3_ROPE_SCALING, PRESETS, make_model, tokenizer_files
from worker.modelgen.presets import BOS_TOKEN_ID, EOS_TOKEN_ID, TOKENIZER_SHA256

torch.set_num_threads(2)

ARCH_NAMES = sorted(ARCHS)
TEXT = "The quick brown fox jumps over the lazy dog. Café, naïve, 🙂!\n\tEnd."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per architecture, shared by the tests that only read them."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_model(root / arch, "tiny", arch) for arch in ARCH_NAMES}


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(path))
    return weights


def load_hf(folder: Path, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


@torch.no_grad()
def logits_of(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


def prompt_ids(folder: Path) -> list[int]:
    return AutoTokenizer.from_pretrained(folder)(TEXT).input_ids


# --- determinism ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"arch": "llama"},
        {"arch": "qwen2", "num_shards": 3, "rope_scaling": LLAMA3_ROPE_SCALING, "num_kv_heads": 1},
    ],
)
def test_same_arguments_give_byte_identical_files(tmp_path: Path, kwargs: dict) -> None:
    first = file_hashes(make_model(tmp_path / "a", seed=7, **kwargs))
    second = file_hashes(make_model(tmp_path / "b", seed=7, **kwargs))
    assert first == second
    assert "config.json" in first and "tokenizer.json" in first


def test_different_seeds_give_different_weights(tmp_path: Path) -> None:
    a = load_weights(make_model(tmp_path / "a", seed=0, with_tokenizer=False))
    b = load_weights(make_model(tmp_path / "b", seed=1, with_tokenizer=False))
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


# --- sizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_tiny_preset_has_under_one_million_parameters(tiny: dict[str, Path], arch: str) -> None:
    count = sum(t.numel() for t in load_weights(tiny[arch]).values())
    assert 100_000 < count < 1_000_000


def test_small_preset_has_about_32m_parameters_and_loads(tmp_path: Path) -> None:
    folder = make_model(tmp_path / "small", "small", "llama")
    model = load_hf(folder, torch.float32)
    assert 30_000_000 < model.num_parameters() < 35_000_000
    config = json.loads((folder / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert config["vocab_size"] == len(tokenizer) == PRESETS["small"].vocab_size
    ids = tokenizer("Hello world").input_ids
    assert torch.isfinite(logits_of(model, ids)).all()


# --- transformers reads every architecture -----------------------------------------------------


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_transformers_loads_each_arch_with_finite_float64_logits(
    tiny: dict[str, Path], arch: str
) -> None:
    model = load_hf(tiny[arch])
    tokenizer = AutoTokenizer.from_pretrained(tiny[arch])
    assert type(model).__name__ == ARCHS[arch].architecture
    assert model.config.vocab_size == len(tokenizer) == PRESETS["tiny"].vocab_size
    ids = tokenizer(TEXT).input_ids
    logits = logits_of(model, ids)
    assert logits.dtype == torch.float64
    assert logits.shape == (len(ids), PRESETS["tiny"].vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_logits_are_peaked_and_greedy_output_varies(tiny: dict[str, Path], arch: str) -> None:
    model = load_hf(tiny[arch], torch.float32)
    ids = prompt_ids(tiny[arch])
    logits = logits_of(model, ids)
    top2 = logits.topk(2, dim=-1).values
    assert logits.std() > 2.0
    assert (top2[:, 0] - top2[:, 1]).median() > 0.1
    generated = model.generate(
        torch.tensor([ids]), max_new_tokens=48, do_sample=False, eos_token_id=None
    )[0, len(ids) :]
    assert len(set(generated.tolist())) >= 8


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_activations_stay_finite_over_a_2000_token_prompt(tiny: dict[str, Path], arch: str) -> None:
    model = load_hf(tiny[arch], torch.float32)
    ids = torch.randint(2, 1024, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = logits_of(model, ids)
    assert torch.isfinite(logits).all()
    assert logits.abs().max() < 1e3


def test_sharded_checkpoint_loads_with_identical_logits(tmp_path: Path) -> None:
    single = make_model(tmp_path / "single", num_shards=1)
    sharded = make_model(tmp_path / "sharded", num_shards=3)
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert all((sharded / n).is_file() for n in names)
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    for name in names:
        assert set(load_file(sharded / name)) == {
            k for k, v in index["weight_map"].items() if v == name
        }
    weights = load_weights(single)
    assert set(index["weight_map"]) == set(weights)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in weights.values())
    ids = prompt_ids(single)
    assert torch.equal(logits_of(load_hf(single), ids), logits_of(load_hf(sharded), ids))


def test_rewriting_a_folder_removes_files_of_the_earlier_call(tmp_path: Path) -> None:
    make_model(tmp_path, num_shards=2)
    make_model(tmp_path, num_shards=1, with_tokenizer=False)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]


# --- the weights a careless runner would get wrong ---------------------------------------------


def test_qwen2_qkv_biases_are_random_nonzero_and_change_the_logits(tiny: dict[str, Path]) -> None:
    biases = {k: v for k, v in load_weights(tiny["qwen2"]).items() if k.endswith(".bias")}
    assert len(biases) == 3 * PRESETS["tiny"].num_layers
    for tensor in biases.values():
        assert (tensor != 0).all() and tensor.std() > 0.1
    model = load_hf(tiny["qwen2"])
    ids = prompt_ids(tiny["qwen2"])
    reference = logits_of(model, ids)
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.bias.zero_()
    assert (logits_of(model, ids) - reference).abs().max() > 0.1


def test_llama_and_mistral_have_no_biases(tiny: dict[str, Path]) -> None:
    for arch in ("llama", "mistral"):
        assert not [k for k in load_weights(tiny[arch]) if k.endswith(".bias")]


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_norm_weights_are_not_ones_and_change_the_logits(tiny: dict[str, Path], arch: str) -> None:
    norms = {k: v for k, v in load_weights(tiny[arch]).items() if "norm" in k}
    assert len(norms) == 2 * PRESETS["tiny"].num_layers + 1
    for tensor in norms.values():
        assert tensor.min() >= 0.5 and tensor.max() <= 1.5 and tensor.std() > 0.1
    model = load_hf(tiny[arch])
    ids = prompt_ids(tiny[arch])
    reference = logits_of(model, ids)
    with torch.no_grad():
        model.model.norm.weight.fill_(1.0)
    assert (logits_of(model, ids) - reference).abs().max() > 0.1


def test_tie_and_kv_head_overrides(tmp_path: Path) -> None:
    tied = make_model(tmp_path / "tied", arch="llama", tie_word_embeddings=True, num_kv_heads=1)
    weights = load_weights(tied)
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)
    model = load_hf(tied)
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 1
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.isfinite(logits_of(model, prompt_ids(tied))).all()
    untied = load_weights(make_model(tmp_path / "untied", arch="qwen2", tie_word_embeddings=False))
    assert "lm_head.weight" in untied


def test_arch_defaults_in_config(tiny: dict[str, Path]) -> None:
    configs = {a: json.loads((tiny[a] / "config.json").read_text()) for a in ARCH_NAMES}
    assert configs["llama"]["tie_word_embeddings"] is False
    assert configs["qwen2"]["tie_word_embeddings"] is True
    assert configs["mistral"]["sliding_window"] is None
    assert AutoConfig.from_pretrained(tiny["mistral"]).sliding_window is None
    for config in configs.values():
        assert config["dtype"] == config["torch_dtype"] == "float32"
        assert (config["bos_token_id"], config["eos_token_id"]) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
    generation = json.loads((tiny["llama"] / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (BOS_TOKEN_ID, EOS_TOKEN_ID)


# --- rope ------------------------------------------------------------------------------------


def rotary_inv_freq(folder: Path, drop: tuple[str, ...] = ()) -> torch.Tensor:
    """inv_freq of the rotary embedding transformers builds from config.json minus `drop` keys."""
    config = json.loads((folder / "config.json").read_text())
    for key in drop:
        config.pop(key)
    (folder / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return model.model.rotary_emb.inv_freq.double()


def llama3_inv_freq(theta: float, head_dim: int, scaling: dict) -> torch.Tensor:
    """Llama 3.1's published frequency scaling, written out independently of transformers."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scaling", [None, LLAMA3_ROPE_SCALING], ids=["default", "llama3"])
def test_both_rope_spellings_give_the_same_frequencies(
    tmp_path: Path, scaling: dict | None
) -> None:
    folder = make_model(tmp_path / "full", with_tokenizer=False, rope_scaling=scaling)
    as_written = rotary_inv_freq(folder)
    new_style = rotary_inv_freq(
        Path(shutil.copytree(folder, tmp_path / "new")), ("rope_scaling", "rope_theta")
    )
    old_style = rotary_inv_freq(
        Path(shutil.copytree(folder, tmp_path / "old")), ("rope_parameters",)
    )
    assert torch.equal(as_written, new_style) and torch.equal(as_written, old_style)
    theta, head_dim = ARCHS["llama"].rope_theta, PRESETS["tiny"].head_dim
    if scaling is None:
        expected = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    else:
        expected = llama3_inv_freq(theta, head_dim, scaling)
        assert not torch.allclose(
            expected, llama3_inv_freq(theta, head_dim, {**scaling, "factor": 1.0})
        )
    torch.testing.assert_close(as_written, expected, rtol=1e-6, atol=0)


def test_llama3_scaling_changes_the_logits(tmp_path: Path) -> None:
    plain = make_model(tmp_path / "plain")
    scaled = make_model(tmp_path / "scaled", rope_scaling=LLAMA3_ROPE_SCALING)
    ids = prompt_ids(plain) * 4  # long enough that low frequencies turn noticeably
    assert (logits_of(load_hf(plain), ids) - logits_of(load_hf(scaled), ids)).abs().max() > 0.1


# --- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_round_trips_text_and_prepends_bos(tiny: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny["llama"])
    assert tokenizer.is_fast
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) == (0, 1, 0)
    ids = tokenizer(TEXT).input_ids
    assert ids[0] == BOS_TOKEN_ID and BOS_TOKEN_ID not in ids[1:]
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    raw = Tokenizer.from_file(str(tiny["llama"] / "tokenizer.json"))
    assert raw.encode(TEXT).ids == ids  # the engine's tokenizers-only path agrees


@pytest.mark.parametrize("vocab_size", sorted(TOKENIZER_SHA256))
def test_shipped_tokenizers_match_their_hashes_and_vocab(vocab_size: int) -> None:
    data = tokenizer_files.read_shipped_tokenizer(vocab_size)
    assert hashlib.sha256(data).hexdigest() == TOKENIZER_SHA256[vocab_size]
    assert len(data) < 2**20  # (the 32,000-token one is the largest, just under 1 MiB)
    tokenizer = Tokenizer.from_str(data.decode())
    assert tokenizer.get_vocab_size() == vocab_size
    assert tokenizer.decode(tokenizer.encode(TEXT).ids) == TEXT
    assert {p.vocab_size for p in PRESETS.values()} <= set(tokenizer_files.tokenizer_vocabs())


def test_a_shipped_vocabulary_other_than_the_presets_gets_its_tokenizer(
        tmp_path: Path) -> None:
    folder = make_model(tmp_path / "m", preset="tiny", vocab_size=32000, chat_template="qwen")
    assert (folder / "tokenizer.json").read_bytes() == \
        tokenizer_files.read_shipped_tokenizer(32000)
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == 32000
    assert "<tool_call>" in json.loads(
        (folder / "tokenizer_config.json").read_text())["chat_template"]
    with pytest.raises(ValueError, match="no tokenizer for a vocabulary of 4096"):
        make_model(tmp_path / "n", preset="tiny", vocab_size=4096)
    with pytest.raises(ValueError, match="unknown chat template"):
        make_model(tmp_path / "o", preset="tiny", chat_template="mistral")


def test_checkpoint_tokenizer_is_a_byte_copy_of_the_shipped_one(tiny: dict[str, Path]) -> None:
    shipped = tokenizer_files.shipped_tokenizer_path(PRESETS["tiny"].vocab_size).read_bytes()
    assert (tiny["llama"] / "tokenizer.json").read_bytes() == shipped


def test_a_tampered_shipped_tokenizer_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = tokenizer_files.shipped_tokenizer_path(1024).read_bytes()
    (tmp_path / "tokenizer-1024.json").write_bytes(original + b" ")  # same JSON, other bytes
    monkeypatch.setattr(tokenizer_files, "DATA_DIR", tmp_path)
    with pytest.raises(RuntimeError, match="sha256"):
        make_model(tmp_path / "model")


def test_without_tokenizer_no_tokenizer_files_are_written(tmp_path: Path) -> None:
    folder = make_model(tmp_path, with_tokenizer=False)
    assert not list(folder.glob("tokenizer*"))


# --- API hygiene ---------------------------------------------------------------------------


def test_modelgen_never_imports_transformers() -> None:
    package = Path(tokenizer_files.__file__).parent
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("transformers") for a in node.names), source
            elif isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("transformers"), source


@pytest.mark.parametrize(
    "kwargs",
    [{"preset": "huge"}, {"arch": "gpt2"}, {"num_kv_heads": 3}, {"num_shards": 0}],
)
def test_bad_arguments_are_rejected(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        make_model(tmp_path, **kwargs)


# ----- real sizes (issue 46): shapes, vocabulary and precision, nothing of that size made -----

def test_the_real_size_presets_are_llama_3s_shapes_rope_and_parameter_counts() -> None:
    from worker.modelgen.config_json import build_config
    from worker.modelgen.safetensors_io import shards_needed
    from worker.modelgen.weights import weight_specs

    expected = {"1b": (1_235_814_400, True, 32.0), "8b": (8_030_261_248, False, 8.0)}
    for name, (params, tied, factor) in expected.items():
        preset = PRESETS[name]
        specs = weight_specs(preset, ARCHS["llama"], preset.num_kv_heads, tied)
        assert sum(s.numel for s in specs.values()) == params, name
        assert ("lm_head.weight" in specs) is not tied
        config = build_config(preset, ARCHS["llama"], preset.num_kv_heads, tied,
                              preset.rope_scaling, preset.dtype)
        assert config["vocab_size"] == 128_256 and config["dtype"] == "bfloat16"
        assert config["rope_theta"] == 500_000.0
        assert config["rope_scaling"]["rope_type"] == "llama3"
        assert config["rope_scaling"]["factor"] == factor
        assert config["max_position_embeddings"] == 131_072
        assert AutoConfig.for_model(**config).num_key_value_heads == 8
    # bfloat16 files of at most 2 GiB each: 2 for the 1b, 8 for the 8b.
    assert shards_needed(1_235_814_400 * 2) == 2 and shards_needed(8_030_261_248 * 2) == 8


def test_llama_3s_vocabulary_decodes_every_id() -> None:
    """The 128,256-token tokenizer is the shipped 32,000-token one and a vocabulary entry
    ``<|id_N|>`` for each further id, that no merge makes: every id a random model samples
    has text, and text encodes as it did."""
    data = tokenizer_files.extended_tokenizer(128_256)
    assert len(data) < 4 * 2**20
    tokenizer = Tokenizer.from_str(data.decode())
    shipped = Tokenizer.from_str(tokenizer_files.read_shipped_tokenizer(32000).decode())
    assert tokenizer.get_vocab_size() == 128_256
    assert tokenizer.encode(TEXT).ids == shipped.encode(TEXT).ids
    assert tokenizer.decode(tokenizer.encode(TEXT).ids) == TEXT
    assert tokenizer.decode([20, 32_000, 70_001, 128_255, 20]) == \
        shipped.decode([20]) + "<|id_32000|><|id_70001|><|id_128255|>" + shipped.decode([20])
    assert all(tokenizer.id_to_token(i) for i in range(128_256))
    # The engine's grammars (llguidance) take it as they do the shipped ones: in a moment
    # (96,256 added tokens instead took them minutes), and a grammar can be compiled.
    from producer.wire.response_format import canonical
    from worker.sampling.grammar import Grammars

    grammars = Grammars(data.decode(), 128_256, [EOS_TOKEN_ID])
    grammars.compile(canonical({"type": "json_object"}))
    assert grammars.compiles == 1


def test_a_bfloat16_checkpoint_drawn_a_file_at_a_time_holds_the_float32_draw_rounded(
        tmp_path: Path) -> None:
    full = make_model(tmp_path / "f32", preset="tiny")
    half = make_model(tmp_path / "bf16", preset="tiny", dtype="bfloat16", num_shards=3)
    reference = load_file(full / "model.safetensors")
    shards = sorted(half.glob("model-*.safetensors"))
    assert len(shards) == 3 and not (half / "model.safetensors").exists()
    got = {k: v for shard in shards for k, v in load_file(shard).items()}
    assert got.keys() == reference.keys()
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    config = json.loads((half / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(half)  # transformers reads the shards
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        make_model(tmp_path / "x", preset="tiny", dtype="float16")


def test_a_device_that_cannot_draw_is_refused_before_any_folder_is_made(tmp_path: Path,
                                                                        capsys) -> None:
    from worker.cli.command import main

    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        make_model(tmp_path / "typo", preset="tiny", device="cdua")
    assert not (tmp_path / "typo" / "config.json").exists()
    if not torch.cuda.is_available():
        assert main(["make-model", str(tmp_path / "m"), "--preset", "tiny",
                     "--device", "cuda"]) == 2
        assert "no CUDA device here" in capsys.readouterr().err
        assert not (tmp_path / "m").exists()
    # A folder is a model once config.json is written, last; it is marked first, so that a
    # making that stopped midway can be made again with --force.
    assert main(["make-model", str(tmp_path / "ok"), "--preset", "tiny"]) == 0
    assert (tmp_path / "ok" / ".conveyor-model").is_file()
