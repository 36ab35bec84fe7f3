"""Every size, architecture default and special token that modelgen uses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class Preset:
    """The shape of a generated model; the architecture only adds biases and rope/eps defaults."""

    hidden_size: int  # width of the residual stream
    num_layers: int  # decoder blocks
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when fewer than num_heads)
    head_dim: int  # per-head width; num_heads * head_dim == hidden_size here
    intermediate_size: int  # SwiGLU MLP width
    vocab_size: int  # equals the tokenizer's vocab size, so no padded rows
    max_position_embeddings: int  # longest context the config advertises
    # The real family's settings where the preset copies one (None: the architecture's).
    rope_theta: float | None = None
    rope_scaling: Mapping[str, Any] | None = None
    tie_word_embeddings: bool | None = None
    # The precision of the files written (a real-size model in float32 would be twice as big).
    dtype: str = "float32"


def _llama3_rope(factor: float) -> Mapping[str, Any]:
    """Llama 3.x's rope scaling (an 8,192-token original context stretched ``factor`` times)."""
    return MappingProxyType({"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192})


# Llama 3's vocabulary: the size of a real model's embedding and LM head (tokenizer_files.py
# says how the generated tokenizer covers every id).
LLAMA3_VOCAB = 128_256


PRESETS: dict[str, Preset] = {
    # Unit tests: ~0.22M parameters, fast enough to run forward passes over 2k tokens on a CPU.
    "tiny": Preset(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=176,
        vocab_size=1024,
        max_position_embeddings=2048,
    ),
    # Benchmarks: ~32.0M parameters untied (27.8M tied), big enough that GPU kernels matter.
    "small": Preset(
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=1408,
        vocab_size=8192,
        max_position_embeddings=4096,
    ),
    # Real sizes (made on the device they will run on, in bfloat16): Llama-3.2-1B's shapes,
    # 1,235,814,400 parameters (the LM head tied), ...
    "1b": Preset(
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=LLAMA3_VOCAB,
        max_position_embeddings=131_072,
        rope_theta=500_000.0,
        rope_scaling=_llama3_rope(32.0),
        tie_word_embeddings=True,
        dtype="bfloat16",
    ),
    # ... and Llama-3.1-8B's, 8,030,261,248 parameters.
    "8b": Preset(
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14_336,
        vocab_size=LLAMA3_VOCAB,
        max_position_embeddings=131_072,
        rope_theta=500_000.0,
        rope_scaling=_llama3_rope(8.0),
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
}


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported Hugging Face architectures."""

    architecture: str  # value of config.json "architectures"
    model_type: str  # value of config.json "model_type"
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2)
    tie_word_embeddings: bool  # default when make_model's override is None
    rope_theta: float  # rotary base; differs per arch so a runner that hardcodes it fails
    rms_norm_eps: float  # RMSNorm epsilon, as the real model families use


ARCHS: dict[str, ArchSpec] = {
    # Llama 2 style: no biases, untied lm_head, theta 1e4.
    "llama": ArchSpec("LlamaForCausalLM", "llama", False, False, 10_000.0, 1e-5),
    # Qwen2 small-model style: q/k/v biases and lm_head tied to the embedding, theta 1e6.
    "qwen2": ArchSpec("Qwen2ForCausalLM", "qwen2", True, True, 1_000_000.0, 1e-6),
    # Mistral v0.2+ style: like Llama but theta 1e6 and sliding_window null (full attention).
    "mistral": ArchSpec("MistralForCausalLM", "mistral", False, False, 1_000_000.0, 1e-5),
}

# A llama3-scaled rope whose original context (256) is short enough that the low and
# medium frequencies of a 16-wide head really change at test lengths. Read-only; copy to vary.
LLAMA3_ROPE_SCALING = MappingProxyType(
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
)

EOS_TOKEN = "<|endoftext|>"  # id 0; also used as the pad token
BOS_TOKEN = "<|begin_of_text|>"  # id 1; the tokenizer prepends it, like Llama's
EOS_TOKEN_ID = 0
BOS_TOKEN_ID = 1
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN)  # trainer order fixes their ids

# SHA-256 of each shipped data/tokenizer-<vocab>.json; regenerate with
# `python -m worker.modelgen.train_tokenizer` and paste the printed hashes here.
TOKENIZER_SHA256: dict[int, str] = {
    1024: "8ed349bb8026fc87fbc3d6ca0252e1b4fce9517ffb227f3136e305d6d71a52a7",
    8192: "9bf39660ebbc2fe21057cec860be042472a0ef382d7d77d3af31609fcc3f090c",
    # No preset's: a Llama-2-sized vocabulary for benchmarks (make-model --vocab-size 32000).
    32000: "9dd913b875a5dd10a8bf4542dd5fbc80bcc796ec16043bee442b0056dbc66633",
}
