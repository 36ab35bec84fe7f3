"""Greedy reference outputs from transformers on the same checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch


@dataclass
class Reference:
    """transformers' greedy tokens for one prompt and, per token, its top-two logit gap."""

    token_ids: list[int]
    gaps: list[float]


@lru_cache(maxsize=4)
def _load(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    return model.eval()


def _generate(model_dir: Path, prompt: list[int], max_tokens: int, **options):
    """transformers' own greedy `generate`, float64, one prompt at a time (no padding)."""
    model = _load(str(model_dir))
    return model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=model.generation_config.eos_token_id,
        **options,
    )


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> Reference:
    """transformers' greedy tokens, with the gap between the top two logits of each step."""
    out = _generate(model_dir, prompt, max_tokens, output_logits=True,
                    return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for step_logits in out.logits:
        top2 = torch.topk(step_logits[0], 2).values
        gaps.append(float(top2[0] - top2[1]))
    return Reference(tokens, gaps)


@torch.inference_mode()
def hf_min_new_tokens(model_dir: Path, prompt: list[int], max_tokens: int, min_tokens: int,
                      bias: dict[int, float]) -> list[int]:
    """transformers' greedy tokens with ``min_new_tokens`` and an additive bias on single
    tokens (``sequence_bias``)."""
    out = _generate(model_dir, prompt, max_tokens, min_new_tokens=min_tokens,
                    sequence_bias={(token,): value for token, value in bias.items()})
    return out[0, len(prompt):].tolist()
