"""Rotary position embeddings, computed bit for bit as transformers computes them.

transformers builds the frequencies and the cos/sin values in float32 whatever the
model dtype and casts the result to the activations' dtype; we do the same so a
float64 model matches a float64 Hugging Face model to the last bits.
"""

from __future__ import annotations

import math

import torch

from worker.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """The ``head_dim // 2`` rotation frequencies, float32, with linear or llama3 scaling."""
    # Explicitly on the CPU: the loader builds models under a "meta" default device.
    exponents = (
        torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    )
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: slow frequencies divided by `factor`, fast ones kept, a ramp between."""
    old_context_len = rope.original_max_position_embeddings
    if old_context_len is None:
        raise ValueError("llama3 rope needs original_max_position_embeddings")
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Swap the two halves of the last dim, negating the second (the non-interleaved convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding:
    """A cos/sin table for positions ``[0, max_positions)``, applied to q and k by position."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        self.inv_freq = inverse_frequencies(rope, head_dim)
        self.max_positions = max_positions
        # One table per (device, dtype): built on first use so loading on "meta" costs nothing.
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[max_positions, head_dim // 2]`` cos and sin tables, in `dtype` on `device`."""
        key = (device, dtype)
        if key not in self._tables:
            self._tables[key] = self._build_table(device, dtype)
        return self._tables[key]

    @torch.inference_mode(False)  # a normal tensor even when first built under inference_mode
    def _build_table(
        self, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # On the CPU in float32 (as transformers does), so every device gets the same bits.
        positions = torch.arange(self.max_positions, dtype=torch.int64, device="cpu")
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width ``[T, head_dim]`` cos and sin for the given positions, in `dtype`."""
        cos, sin = self.tables(positions.device, dtype)
        cos, sin = cos[positions], sin[positions]
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by ``cos``/``sin [T, head_dim]`` from `cos_sin`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    # ``x * cos + rotate_half(x) * sin`` with the halves swapped into one buffer and the
    # products and sum made in place: the same bits, two [T, heads, head_dim] buffers
    # fewer (a prefill chunk's q is megabytes, and fresh buffers cost more than the work).
    # (Slice copies and in-place ops, not ``out=``: autograd can follow them.)
    half = x.shape[-1] // 2
    rotated = torch.empty_like(x)
    rotated[..., :half] = x[..., half:]
    rotated[..., half:] = x[..., :half]
    rotated[..., :half].neg_()
    return (x * cos).add_(rotated.mul_(sin))
