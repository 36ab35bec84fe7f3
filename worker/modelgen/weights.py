"""Draw the random, deterministic weights of a generated decoder model, one tensor at a time.

Each tensor is drawn in float32 from a generator seeded by the weight seed and its name, on
the device asked for, then cast: the same arguments give the same bytes on one kind of
device (CUDA's generator draws other numbers than the CPU's).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class TensorSpec:
    """One weight to draw: normal of std ``a``, or uniform in [``a``, ``b``)."""

    shape: tuple[int, ...]
    kind: str  # "normal" or "uniform"
    a: float
    b: float = 0.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def draw(seed: int, name: str, spec: TensorSpec, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu") -> torch.Tensor:
    """The tensor ``name`` of a checkpoint made with ``seed``, on ``device`` in ``dtype``."""
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    # (in place: one float32 copy of an 8B model's embedding is 2 GiB)
    if spec.kind == "normal":
        t = torch.randn(spec.shape, generator=gen, dtype=torch.float32, device=device)
        t.mul_(spec.a)
    else:
        t = torch.rand(spec.shape, generator=gen, dtype=torch.float32, device=device)
        t.mul_(spec.b - spec.a).add_(spec.a)
    return t if dtype == torch.float32 else t.to(dtype)


def weight_specs(
    preset: Preset, arch: ArchSpec, num_kv_heads: int, tie_word_embeddings: bool
) -> dict[str, TensorSpec]:
    """The Hugging Face state dict's tensors, in module order; lm_head is omitted when tied."""
    h, inter, d = preset.hidden_size, preset.intermediate_size, preset.head_dim
    q_out, kv_out = preset.num_heads * d, num_kv_heads * d
    specs: dict[str, TensorSpec] = {}

    def normal(name: str, shape: tuple[int, ...], std: float) -> None:
        specs[name] = TensorSpec(shape, "normal", std)

    def norm(name: str) -> None:
        specs[name] = TensorSpec((h,), "uniform", *NORM_RANGE)

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
    return specs
