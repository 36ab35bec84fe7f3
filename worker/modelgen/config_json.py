"""Build config.json and generation_config.json for a generated checkpoint.

Rope is written twice, on purpose. transformers >= 5 reads ``rope_parameters``
(``rope_type``, ``rope_theta`` and any scaling keys in one dict); older readers
(transformers 4.x, most engines) read top-level ``rope_theta`` plus
``rope_scaling`` (null, or the scaling dict without ``rope_theta``). Both carry the
same values. transformers 5.24 gives a non-null ``rope_scaling`` priority over
``rope_parameters`` and then fills ``rope_theta`` from the top-level key, so every
reader ends with the same rope either way (checked in tests/test_make_model.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from worker.modelgen.presets import BOS_TOKEN_ID, EOS_TOKEN_ID, ArchSpec, Preset


def dump_json(obj: Mapping[str, Any]) -> bytes:
    """Serialise with sorted keys and a trailing newline, so files are byte-stable."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def rope_fields(theta: float, rope_scaling: Mapping[str, Any] | None) -> dict[str, Any]:
    """The rope keys of config.json in both the old and the transformers-5 spelling."""
    if rope_scaling is None:
        return {
            "rope_theta": theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        }
    scaling = dict(rope_scaling)
    rope_type = scaling.pop("type", None) or scaling.get("rope_type")
    if not rope_type:
        raise ValueError("rope_scaling needs a 'rope_type'")
    if "rope_theta" in scaling:
        raise ValueError("rope_theta comes from the preset or the architecture, not "
                         "rope_scaling")
    scaling["rope_type"] = rope_type
    return {
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_parameters": {**scaling, "rope_theta": theta},
    }


def build_config(
    preset: Preset,
    arch: ArchSpec,
    num_kv_heads: int,
    tie_word_embeddings: bool,
    rope_scaling: Mapping[str, Any] | None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The config.json contents for this preset and architecture (the preset's rope theta
    where it has one, else the architecture's), for weights in ``dtype``."""
    config: dict[str, Any] = {
        "architectures": [arch.architecture],
        "model_type": arch.model_type,
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": arch.rms_norm_eps,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        # "dtype" for transformers >= 4.56, "torch_dtype" for older readers.
        "dtype": dtype,
        "torch_dtype": dtype,
        **rope_fields(preset.rope_theta or arch.rope_theta, rope_scaling),
    }
    if arch.model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch.model_type == "qwen2":
        # Qwen2's q/k/v biases are implied by the architecture; no flag exists for them.
        # Layers at index >= max_window_layers would slide; none do.
        config.update(
            use_sliding_window=False, sliding_window=None, max_window_layers=preset.num_layers
        )
    elif arch.model_type == "mistral":
        config.update(sliding_window=None)
    return config


def build_generation_config() -> dict[str, Any]:
    """generation_config.json: the special ids generate() needs, pad = eos."""
    return {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": EOS_TOKEN_ID,
    }
