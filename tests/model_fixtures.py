"""Tiny Hugging Face checkpoints, written by transformers itself, for model tests.

Each kind is a real architecture at toy size with random weights from a fixed
seed. Norm weights are pushed away from 1 and biases away from 0 so that a
forgotten scale or bias shows up in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 128
MAX_POSITIONS = 512
# Shapes shared by every kind; each kind overrides what it tests.
_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POSITIONS,
    # Larger than the default 0.02 so attention is far from uniform and mistakes show.
    initializer_range=0.1,
    rms_norm_eps=1e-5,
    eos_token_id=2,
)
# kind -> (config class, model class, overrides of _BASE).
KINDS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama_tied_bias": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    ),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None, head_dim=16)),
    "mqa": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=1)),
    # head_dim 8 gives wavelengths 6.3, 63, 628, 6283: one kept, one smoothed, two divided.
    "llama3_rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            )
        ),
    ),
    "sharded": (LlamaConfig, LlamaForCausalLM, dict(num_hidden_layers=3)),
    # Saved with rope_parameters, then config.json rewritten with the pre-5.0 keys.
    "old_style_rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rope_parameters=dict(rope_type="linear", rope_theta=5000.0, factor=2.0)),
    ),
}


def write_checkpoint(kind: str, path: Path, seed: int = 0) -> PreTrainedModel:
    """Save checkpoint `kind` into `path`; returns the Hugging Face model, float64, eval mode."""
    config_cls, model_cls, overrides = KINDS[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**_BASE, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn_like(param))
    model.save_pretrained(path, max_shard_size="20KB" if kind == "sharded" else "5GB")
    if kind == "old_style_rope":
        rewrite_rope_old_style(path / "config.json")
    return model.to(torch.float64).eval()


def rewrite_rope_old_style(config_file: Path) -> None:
    """Swap ``rope_parameters`` for top-level ``rope_theta`` and ``rope_scaling`` with ``type``."""
    raw = json.loads(config_file.read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    raw["rope_scaling"] = params
    config_file.write_text(json.dumps(raw, indent=2))


def hf_logits(model: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits ``[len, vocab]`` from the Hugging Face model."""
    with torch.no_grad():
        return model(tokens[None]).logits[0]
