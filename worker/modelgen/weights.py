"""Draw the random, deterministic float32 weights of a generated decoder model."""

from __future__ import annotations

import hashlib

import torch

from worker.modelgen.presets import ArchSpec, Preset

# Init scales. Every projection sees an RMS-normalised input (or one of unit scale),
# so std = gain / sqrt(fan_in) gives outputs of RMS ~gain and activations stay sane
# through any number of layers and positions.
QK_GAIN = 1.5  # q and k coordinates of std 1.5: attention scores of std ~2, so fairly sharp
# o_proj/down_proj: layer outputs dwarf the embedding in the residual stream, else a tied
# lm_head scores the input token highest and greedy decoding repeats it forever.
OUT_GAIN = 4.0
LOGIT_STD = 4.0  # lm_head gain: logits of std ~4 give a clear top token
EMBED_STD = 1.0  # untied input embedding; the first RMSNorm rescales it anyway
BIAS_STD = 0.5  # q/k/v biases: large enough that dropping one changes the logits visibly
NORM_RANGE = (0.5, 1.5)  # RMSNorm weights: uniform, so a runner ignoring them is caught


def tensor_seed(seed: int, name: str) -> int:
    """A per-tensor seed, so one tensor's values never depend on which others exist."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, name))
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _uniform(seed: int, name: str, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, name))
    return torch.rand(shape, generator=gen, dtype=torch.float32) * (high - low) + low


def init_weights(
    preset: Preset, arch: ArchSpec, num_kv_heads: int, tie_word_embeddings: bool, seed: int
) -> dict[str, torch.Tensor]:
    """Return the Hugging Face state dict, in module order; lm_head is omitted when tied."""
    h, inter, d = preset.hidden_size, preset.intermediate_size, preset.head_dim
    q_out, kv_out = preset.num_heads * d, num_kv_heads * d
    weights: dict[str, torch.Tensor] = {}

    def normal(name: str, shape: tuple[int, ...], std: float) -> None:
        weights[name] = _normal(seed, name, shape, std)

    def norm(name: str) -> None:
        weights[name] = _uniform(seed, name, (h,), *NORM_RANGE)

    # Tied: the embedding doubles as lm_head, so it takes lm_head's scale.
    embed_std = LOGIT_STD / h**0.5 if tie_word_embeddings else EMBED_STD
    normal("model.embed_tokens.weight", (preset.vocab_size, h), embed_std)
    for i in range(preset.num_layers):
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm.weight")
        normal(f"{p}.self_attn.q_proj.weight", (q_out, h), QK_GAIN / h**0.5)
        normal(f"{p}.self_attn.k_proj.weight", (kv_out, h), QK_GAIN / h**0.5)
        normal(f"{p}.self_attn.v_proj.weight", (kv_out, h), 1 / h**0.5)
        if arch.qkv_bias:
            normal(f"{p}.self_attn.q_proj.bias", (q_out,), BIAS_STD)
            normal(f"{p}.self_attn.k_proj.bias", (kv_out,), BIAS_STD)
            normal(f"{p}.self_attn.v_proj.bias", (kv_out,), BIAS_STD)
        normal(f"{p}.self_attn.o_proj.weight", (h, q_out), OUT_GAIN / q_out**0.5)
        norm(f"{p}.post_attention_layernorm.weight")
        normal(f"{p}.mlp.gate_proj.weight", (inter, h), 1 / h**0.5)
        normal(f"{p}.mlp.up_proj.weight", (inter, h), 1 / h**0.5)
        normal(f"{p}.mlp.down_proj.weight", (h, inter), OUT_GAIN / inter**0.5)
    norm("model.norm.weight")
    if not tie_word_embeddings:
        normal("lm_head.weight", (preset.vocab_size, h), LOGIT_STD / h**0.5)
    return weights
