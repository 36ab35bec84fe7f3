"""A decode-only step's decoder layers, final norm and (asked for) LM head in one native call
(csrc/decode_layers.cpp).

On the Python path a decode step is its matmuls plus ~250 small ops whose dispatch,
allocation and thread-team starts add up; the native call makes the same matmul calls and
fuses the rest, the final norm and the LM head included (docs/cpu-kernels.md; figures in
docs/benchmarks.md, "Decode step against its own matmuls"). It runs without the GIL, so
the worker's I/O threads are not queued behind the engine's ops either.

It applies to a step whose every sequence brings one token, or to a step of at most
``MAX_MIXED_TOKENS`` with prefill chunks (each chunk's token attends as a row of its own),
on the CPU, with float32 activations, weights and cache, where the CPU kernels are built;
anything else (a larger prefill step, another dtype or device) runs the Python layers,
which compute the same thing. Its matmuls are worker/models/linear.py's (the packed kernel
on the packed copies of worker/models/packed_weights.py; without them the skinny kernel for
a small batch, oneDNN's past it; the BLAS with ``CONVEYOR_CPU_MATMUL=blas``), four a layer:
q/k/v as one matrix and gate/up as one, views that the loader's weight arena makes possible
(worker/models/weight_arena.py); a model whose weights do not lie so runs the Python layers.
``CONVEYOR_CPU_DECODE_LAYERS=0`` switches the native call off (to compare).

Where every projection has its packed copy, the step's stages run as one parallel region
whose master does not wait for a thread that lost its core: it computes that thread's late
tasks itself and goes on (csrc/step_team.h). On a machine whose cores the engine shares
with the worker's I/O, Redis and clients, that is where a step's time went: every time
another process took a core from one thread of the team, the other waited at the next
region's end for as long as it was gone. ``CONVEYOR_CPU_STEP_TEAM=0`` runs a region per
loop instead (to compare); both compute the same bits.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from kvstore.kv_tensors import PagedKVCache
from producer import settings
from worker.attention.metadata import AttentionMetadata
from worker.models import packed_weights
from worker.models.linear import NO_BIAS, blas_only
from worker.models.weight_arena import joined

if TYPE_CHECKING:
    from worker.models.llama import CausalLM

# Each model's projection weights, their parameters' versions and their packed copies, as
# _packed_projections last made them.
_PACKED: weakref.WeakKeyDictionary[
    torch.nn.Module, tuple[list[torch.Tensor], tuple[int, ...], list[torch.Tensor]]] = (
    weakref.WeakKeyDictionary())

# A layer's tensors in _model_weights' list, and where its four projection weights lie in it.
_PER_LAYER = 10
_PROJECTIONS = (1, 3, 6, 8)

# The most tokens a step with prefill chunks may hold and still take the native path (the
# step team's row limit, kPackedMaxRows). Such a step on the Python path pays ~20 ms of
# small ops on the small preset (a third of a 48-row decode step), which a step sized by an
# inter-token target pays at every chunk; past this size, the Python layers' attention (one
# matmul a chunk, where the call reads the context once per token) can be the cheaper.
MAX_MIXED_TOKENS = 192

# Each model's layer tensors in the kernel's order (_model_weights), or None, by model.
_WEIGHTS: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.Tensor] | None] = (
    weakref.WeakKeyDictionary())


def enabled() -> bool:
    return settings.cpu_decode_layers()


def team_enabled() -> bool:
    """Whether the step runs as one region with take-overs (csrc/step_team.h)."""
    return settings.cpu_step_team()


def team_takeovers() -> int:
    """Tasks a step's master computed for a thread that was late with them, in this process
    so far: how often the engine's threads lost their core mid-step and the step went on."""
    from worker.host.cpu_kernels import cpu_kernels

    module = cpu_kernels()
    return int(module.step_team_counts()[0]) if module is not None else 0


def applies(x: torch.Tensor, kv_cache: PagedKVCache, meta: AttentionMetadata) -> bool:
    """Whether this step can take the native path (the kernel's availability aside)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32
            and kv_cache.k[0].dtype == torch.float32
            # T tokens over B sequences: T == B is all decodes; prefill chunks beside them
            # take the path up to a step of MAX_MIXED_TOKENS.
            and (x.shape[0] == len(meta.query_lens) or x.shape[0] <= MAX_MIXED_TOKENS)
            and meta.positions is not None and enabled())


def per_token(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's block table and attention length, as the kernel takes them: a decode-only
    step's own; a step with prefill chunks gives each chunk's token its sequence's table and
    the context up to itself. That is causal attention, token by token: the kernel writes
    every token's K/V to the cache before any token attends (csrc/decode_layers.cpp)."""
    if len(meta.query_lens) == meta.slot_mapping.shape[0]:
        return meta.block_tables.contiguous(), meta.seq_lens.contiguous()
    lens = torch.tensor(meta.query_lens, dtype=torch.int64, device=meta.block_tables.device)
    tables = meta.block_tables.repeat_interleave(lens, dim=0)
    return tables, (meta.positions + 1).contiguous()


def decode_layers(model: CausalLM, x: torch.Tensor, kv_cache: PagedKVCache,
                  meta: AttentionMetadata, logits: bool = False) -> torch.Tensor | None:
    """Run every decoder layer and the final norm over the embeddings ``x [T, hidden]`` of a
    decode-only step (or of a small step with prefill chunks: ``per_token``), writing each
    token's K/V to the cache: the normed hidden states ``[T, hidden]``, or with ``logits``
    the LM head's ``[T, vocab]`` (in the same call: in the step team's region, with its
    take-overs, where the LM head is packed); None where the native path does not apply
    (the caller then runs the Python layers)."""
    if not applies(x, kv_cache, meta):
        return None
    from worker.host.cpu_kernels import decode_layers_kernel

    kernel = decode_layers_kernel()
    if kernel is None:
        return None
    config = model.config
    cos, sin = model.rotary.tables(x.device, x.dtype)
    weights = _gathered(model)
    if weights is None:
        return None
    head, head_packed = NO_BIAS, NO_BIAS  # what the kernel takes for "none"
    if logits:
        head = model.lm_head.weight
        if head.dtype != torch.float32:
            return None
        head_packed = packed_weights.packed(head)
        head_packed = NO_BIAS if head_packed is None else head_packed
    return kernel(
        x.contiguous(), meta.positions.contiguous(), cos, sin, meta.slot_mapping.contiguous(),
        *per_token(meta), weights,
        _packed_projections(model, weights), model.model.norm.weight.contiguous(), head,
        head_packed, kv_cache.k,
        kv_cache.v, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        meta.block_size, config.rms_norm_eps, config.head_dim**-0.5, blas_only(),
        team_enabled())


@torch.no_grad()
def prepare(model: CausalLM) -> None:
    """Make the packed copies a decode step multiplies by now (the decoder layers' where the
    native step is on, and the LM head's), so that the first step does not."""
    weights = _gathered(model) if enabled() else None
    if weights is not None:
        _packed_projections(model, weights)
    packed_weights.packed(model.lm_head.weight)


def _gathered(model: CausalLM) -> list[torch.Tensor] | None:
    if model not in _WEIGHTS:
        # Gathered once: reading ~130 tensors through nn.Module attributes every step cost
        # ~0.35 ms. The loader fills the parameters in place, so the list stays true; a
        # model moved or cast (nn.Module._apply) forgets it (CausalLM._apply).
        _WEIGHTS[model] = _model_weights(model)
    return _WEIGHTS[model]


def _packed_projections(model: CausalLM, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The packed copies of each layer's q/k/v, o, gate/up and down weights, in the kernel's
    order; none at all where any of them has none. Kept by model with the version of every
    parameter they were made from: a step reads ~60 version counters (~25 us), where asking
    packed_weights for each copy cost ~0.6 ms."""
    if not packed_weights.enabled():
        return []
    projections = [weights[i + offset] for i in range(0, len(weights), _PER_LAYER)
                   for offset in _PROJECTIONS] if model not in _PACKED else _PACKED[model][0]
    versions = packed_weights.versions(projections)
    if model in _PACKED and _PACKED[model][1] == versions:
        return _PACKED[model][2]
    copies = [packed_weights.packed(w) for w in projections]
    kept = [] if any(c is None for c in copies) else copies
    _PACKED[model] = (projections, versions, kept)
    return kept


def forget(model: torch.nn.Module) -> None:
    """Drop the model's gathered weights (its parameters are about to be moved or cast)."""
    _WEIGHTS.pop(model, None)
    _PACKED.pop(model, None)


def _model_weights(model: CausalLM) -> list[torch.Tensor] | None:
    """Every layer's tensors in the order csrc/decode_layers.cpp reads them; None where a
    layer's q/k/v or gate/up weights do not lie back to back (a model that
    worker/models/loader.py did not lay out), which the kernel needs."""
    out: list[torch.Tensor] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        # .contiguous() costs nothing on the usual weights and keeps an odd checkpoint's
        # view from failing the kernel's checks mid-step.
        out.append(layer.input_layernorm.weight.contiguous())
        for projections in ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,)):
            out += _fused(projections)
        out.append(layer.post_attention_layernorm.weight.contiguous())
        for projections in ((mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)):
            out += _fused(projections)
    return None if any(w is None for w in out) else out


def _fused(projections: tuple[torch.nn.Linear, ...]) -> list[torch.Tensor | None]:
    """The projections' weights as one matrix and their biases as one vector (views)."""
    weight = joined([p.weight for p in projections])
    if weight is not None and len(projections) > 1:  # its packed copy checks each one's version
        setattr(weight, packed_weights.SOURCES, tuple(p.weight for p in projections))
    if all(p.bias is None for p in projections):
        return [weight, NO_BIAS]
    if any(p.bias is None for p in projections):
        return [None, None]  # the checkpoint has some of the biases only: no kernel for that
    return [weight, joined([p.bias for p in projections])]
