"""The architecture of a Llama-family checkpoint, read from its Hugging Face config files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Architectures this decoder covers, by the name `config.json` lists.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
# Fallback when `architectures` is absent: the `model_type` each architecture saves.
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# transformers' default base when a config names no rope_theta.
DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, in the form transformers 5 calls `rope_parameters`."""

    # "default", "linear" or "llama3".
    rope_type: str
    # Base wavelength of the frequencies.
    theta: float
    # Linear and llama3: how much the context was stretched (1.0 means unscaled).
    factor: float = 1.0
    # llama3: wavelengths above original_max / low_freq_factor are divided by `factor`.
    low_freq_factor: float = 1.0
    # llama3: wavelengths below original_max / high_freq_factor are kept as they are.
    high_freq_factor: float = 4.0
    # llama3: the context length the model was pretrained with.
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know about a checkpoint's shapes and numerics."""

    # Which Hugging Face class saved it: decides the defaults for biases.
    architecture: str
    # Rows of the embedding table and of the LM head.
    vocab_size: int
    # Width of the residual stream.
    hidden_size: int
    # Decoder layers.
    num_hidden_layers: int
    # Query heads per layer.
    num_attention_heads: int
    # K/V heads per layer (fewer than query heads for GQA, 1 for MQA).
    num_key_value_heads: int
    # Width of one head; may differ from hidden_size / num_attention_heads.
    head_dim: int
    # Width of the SwiGLU MLP.
    intermediate_size: int
    # Epsilon inside every RMSNorm.
    rms_norm_eps: float
    # Longest position the model was configured for (size of the rope cache).
    max_position_embeddings: int
    # The LM head reuses the embedding table.
    tie_word_embeddings: bool
    # q/k/v projections carry a bias (always for Qwen2, `attention_bias` for Llama).
    qkv_bias: bool
    # The output projection carries a bias (Llama `attention_bias` only).
    o_bias: bool
    # gate/up/down projections carry a bias (Llama `mlp_bias`).
    mlp_bias: bool
    # Rotary embedding parameters.
    rope: RopeConfig
    # Token ids that end generation: generation_config.json's first, then config.json's.
    eos_token_ids: list[int]
    # Token id prepended by the tokenizer, if the checkpoint names one.
    bos_token_id: int | None = None
    # dtype the weights were saved in ("bfloat16", ...), if the checkpoint says.
    checkpoint_dtype: str | None = None

    @property
    def num_query_groups(self) -> int:
        """Query heads that share one K/V head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` if present) from a checkpoint folder."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        raw = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from the parsed contents of `config.json` and `generation_config.json`."""
        arch = _architecture(raw)
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"unsupported hidden_act {raw['hidden_act']!r}: only 'silu' is implemented"
            )
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        hidden = int(raw["hidden_size"])
        max_pos = int(raw["max_position_embeddings"])
        _check_no_sliding_window(arch, raw, max_pos)
        qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=not qwen2 and attention_bias,
            mlp_bias=not qwen2 and bool(raw.get("mlp_bias", False)),
            rope=_rope_config(raw, max_pos),
            eos_token_ids=_eos_ids(raw, generation or {}),
            bos_token_id=raw.get("bos_token_id"),
            checkpoint_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") in _ARCH_BY_MODEL_TYPE:
        archs = [_ARCH_BY_MODEL_TYPE[raw["model_type"]]]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(
        f"unsupported architecture {archs or raw.get('model_type')!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _check_no_sliding_window(arch: str, raw: dict[str, Any], max_pos: int) -> None:
    """Refuse checkpoints whose attention is windowed within the positions we would serve."""
    window = raw.get("sliding_window")
    # Qwen2 saves a window size but only applies it when use_sliding_window is set.
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        window = None
    if arch == "LlamaForCausalLM":
        window = None
    if window is not None and int(window) < max_pos:
        raise ValueError(
            f"{arch} with sliding_window={window} < max_position_embeddings={max_pos} is not "
            "supported: only full causal attention is implemented"
        )


def _rope_config(raw: dict[str, Any], max_pos: int) -> RopeConfig:
    """Read rope settings from transformers 5's `rope_parameters` or the older top-level keys."""
    # transformers 5 lets an old-style `rope_scaling` win over `rope_parameters`.
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", raw.get("rope_theta"))
    theta = float(theta if theta is not None else DEFAULT_ROPE_THETA)
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if rope_type == "default":
        return RopeConfig("default", theta)
    needed = ["factor"] + (["low_freq_factor", "high_freq_factor"] if rope_type == "llama3" else [])
    if missing := [key for key in needed if key not in params]:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)}")
    if rope_type == "linear":
        return RopeConfig("linear", theta, factor=float(params["factor"]))
    # As transformers: a top-level original_max_position_embeddings wins, then the dict's.
    original = raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings", max_pos
    )
    return RopeConfig(
        "llama3",
        theta,
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(original),
    )


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    """Union of the eos ids in generation_config.json and config.json, each an int or a list."""
    ids: list[int] = []
    for source in (generation.get("eos_token_id"), raw.get("eos_token_id")):
        values = source if isinstance(source, list) else [] if source is None else [source]
        for value in values:
            if int(value) not in ids:
                ids.append(int(value))
    return ids
