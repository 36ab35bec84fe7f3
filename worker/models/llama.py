"""One decoder for Llama, Qwen2 and Mistral checkpoints, run over a flat ragged batch.

Module and parameter names match the Hugging Face safetensors keys, so loading a
checkpoint is a plain state-dict copy. Numerics follow transformers (RMSNorm in
float32, rope tables in float32) so a float64 model matches a float64 Hugging Face
model to rounding error.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kvstore.kv_tensors import PagedKVCache
from worker.attention import get_attention_backend
from worker.attention.metadata import AttentionMetadata
from worker.models import native_decode, packed_weights
from worker.models.config import ModelConfig
from worker.models.linear import Linear, linear
from worker.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in float32 like transformers."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # transformers casts to float32 for every dtype (a downcast for float64): we match it.
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        # In place on the tensor made just above (an elementwise product is the same bits
        # either way round): one [T, hidden] buffer less a norm.
        return x.to(dtype).mul_(self.weight)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(hidden, inner, bias=bias)
        self.up_proj = Linear(hidden, inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SiLU and the product in place on the gate's own output: the same bits as
        # ``silu(gate(x)) * up(x)`` without two more [T, intermediate] buffers, which in a
        # prefill chunk cost more than the elementwise work itself.
        gate = F.silu(self.gate_proj(x), inplace=True)
        return self.down_proj(gate.mul_(self.up_proj(x)))


class Attention(nn.Module):
    """Self-attention projections plus rope; the paged attention itself is the backend's."""

    def __init__(self, config: ModelConfig, backend_cls: type) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(hidden, q_width, bias=config.qkv_bias)
        self.k_proj = Linear(hidden, kv_width, bias=config.qkv_bias)
        self.v_proj = Linear(hidden, kv_width, bias=config.qkv_bias)
        self.o_proj = Linear(q_width, hidden, bias=config.o_bias)
        scale = self.head_dim**-0.5
        self.attn = backend_cls(self.num_heads, self.num_kv_heads, self.head_dim, scale)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        return self.o_proj(self.attn.forward(q, k, v, k_cache, v_cache, meta))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, config: ModelConfig, backend_cls: type) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend_cls)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, k_cache, v_cache, meta)
        # The second residual add in place on the sum just made (the layer's input, which
        # the caller may still hold, is never written).
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm (the ``model.`` prefix of the checkpoint)."""

    def __init__(self, config: ModelConfig, backend_cls: type) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend_cls) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A Llama-family causal LM over one flat ragged batch (prefill chunks and decodes mixed)."""

    def __init__(self, config: ModelConfig, attention_backend: str = "torch",
                 device_type: str = "cpu") -> None:
        super().__init__()
        self.config = config
        backend_cls = get_attention_backend(attention_backend, device_type)
        # The runner stages the backend's per-step plan with the step's inputs.
        self.attention_backend = backend_cls
        self.model = DecoderModel(config, backend_cls)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        # Steps whose layers ran in one native call (worker/models/native_decode.py).
        self.num_native_steps = 0
        # Of those, steps with prefill chunks (each chunk's token a row of the call's).
        self.num_native_mixed_steps = 0

    def _apply(self, fn, *args, **kwargs):  # noqa: ANN001, ANN202 - nn.Module's signature
        # .to(), .float(), .cuda() and the like re-point the parameters: the native decode
        # step's list of them (views of the old memory) must be gathered again, and the LM
        # head's packed copy goes with the memory it was made from.
        native_decode.forget(self)
        packed_weights.forget(self.lm_head.weight)
        return super()._apply(fn, *args, **kwargs)

    def tie_weights(self) -> None:
        """Share the embedding table with the LM head if the config says so (again after moves)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run ``input_ids [T]`` at ``positions [T]``; returns normed hidden states ``[T, hidden]``.

        Each token's K/V is written to the cache at ``meta.slot_mapping`` on the way.
        Positions must be below ``config.max_position_embeddings``.
        """
        x = self.model.embed_tokens(input_ids)
        native = native_decode.decode_layers(self, x, kv_cache, meta)
        if native is not None:
            self.num_native_steps += 1
            self.num_native_mixed_steps += x.shape[0] != len(meta.query_lens)
            return native
        return self.decoder_layers(x, positions, kv_cache, meta)

    def logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward``, then the logits ``[N, vocab]`` of the tokens at ``rows`` (every token
        where None). A decode-only step on the native path makes them in the same call as
        its layers (worker/models/native_decode.py), without ``forward``: hooks on the
        module do not see it (the embedding's do, on every step)."""
        if rows is not None:
            return self.compute_logits(self(input_ids, positions, kv_cache, meta)[rows])
        x = self.model.embed_tokens(input_ids)
        native = native_decode.decode_layers(self, x, kv_cache, meta, logits=True)
        if native is not None:
            self.num_native_steps += 1
            return native
        return self.compute_logits(self.decoder_layers(x, positions, kv_cache, meta))

    def decoder_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                       meta: AttentionMetadata) -> torch.Tensor:
        """The Python decoder layers and the final norm over the embeddings ``x`` (what a
        captured decode graph runs: worker/models/decode_graphs.py)."""
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos_sin, kv_cache.k[i], kv_cache.v[i], meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project ``hidden [N, hidden]`` to ``[N, vocab]`` logits."""
        weight = self.lm_head.weight
        return linear(hidden, weight, packed=packed_weights.packed(weight))
