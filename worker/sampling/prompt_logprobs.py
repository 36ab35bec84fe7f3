"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and the
most likely alternatives there, computed in the prefill that runs anyway.

The logits at position p predict the token at p + 1, so a prefill chunk over positions
[s, s + n) gives the prompt's tokens s + 1 .. s + n their logprobs (the prompt's last
position predicts the first output token: that row is the sampler's). A step with such a
chunk makes the logits of every row of that chunk, and of the last row of each other
sampling chunk; the sampler reads its rows out of those. The chunks of a chunked prefill
come in order, each adding its span. A request whose prompt is computed again (preempted
before its first token) gives the same span again; the engine keeps the first.

Logprobs are computed in the logits' dtype (float64 on a float64 model, never rounded
through float32); bfloat16 and float16 logits are widened to float32 first.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from producer.wire.completion import TokenLogprob
from producer.wire.params import SamplingParams
from worker.host.step_upload import Staged, StepUpload

# One request's span of prompt logprobs from one step: (the first prompt position it gives
# a logprob to, one TokenLogprob per position from there).
PromptSpan = tuple[int, list[TokenLogprob]]


@dataclass
class PromptPlan:
    """What a step with prompt-logprob chunks computes: the rows whose logits are made,
    where the sampler's rows are among them, and each chunk's span."""

    picked: Staged
    sample_at: Staged | None
    # Positions (among the picked rows) of every span's rows, and the prompt token each
    # row's logits are read at.
    rows: Staged
    targets: Staged
    target_ids: list[int]
    # (request id, first position, number of rows, alternatives) per span, in row order.
    spans: list[tuple[str, int, int, int]] = field(default_factory=list)


class PromptLogprobs:
    """The running requests that still want prompt logprobs (kept across steps, like their
    sampling rows): added with the request, released when it finishes or is preempted."""

    def __init__(self) -> None:
        self._wanted: dict[str, tuple[int, Sequence[int]]] = {}

    def __bool__(self) -> bool:
        return bool(self._wanted)

    def add(self, request_id: str, params: SamplingParams, prompt: Sequence[int],
            output: Sequence[int]) -> None:
        """A request given a table (admission, swap-in, resumption): wanted while it has no
        output token (after its first, every prompt logprob is known)."""
        self._wanted.pop(request_id, None)
        if params.prompt_logprobs is not None and not output:
            self._wanted[request_id] = (params.prompt_logprobs, prompt)

    def release(self, request_id: str) -> None:
        self._wanted.pop(request_id, None)

    def plan(self, chunks: Sequence, upload: StepUpload) -> PromptPlan | None:
        """The step's plan, staged in ``upload``; None when no chunk of it reads a prompt
        position whose next token is in the prompt (then the step runs as any other)."""
        picked: list[int] = []
        sample_at: list[int] = []
        rows: list[int] = []
        targets: list[int] = []
        spans = []
        offset = 0
        for c in chunks:
            n = c.num_tokens
            wanted = self._wanted.get(c.request_id)
            count = 0
            if wanted is not None:
                k, prompt = wanted
                start = c.start_position
                count = max(0, min(start + n, len(prompt) - 1) - start)
                if start + n >= len(prompt) - 1:  # its last span: wanted no more
                    del self._wanted[c.request_id]
            if count:
                at = len(picked)
                picked.extend(range(offset, offset + n))
                rows.extend(range(at, at + count))
                targets.extend(prompt[start + 1:start + 1 + count])
                spans.append((c.request_id, start + 1, count, k))
                if c.sample:
                    sample_at.append(at + n - 1)
            elif c.sample:
                sample_at.append(len(picked))
                picked.append(offset + n - 1)
            offset += n
        if not spans:
            return None
        stage = lambda values: upload.add(np.asarray(values, dtype=np.int64))  # noqa: E731
        return PromptPlan(stage(picked), stage(sample_at) if sample_at else None, stage(rows),
                          stage(targets), targets, spans)

    @staticmethod
    def compute(logits: torch.Tensor, plan: PromptPlan) -> dict[str, PromptSpan]:
        """Each span's logprobs from ``logits`` (one row per picked row)."""
        x = logits.index_select(0, plan.rows.tensor)
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        logp = torch.log_softmax(x, dim=-1)
        chosen = logp.gather(1, plan.targets.tensor[:, None]).squeeze(1).tolist()
        most = max(k for *_, k in plan.spans)
        top_ids: list[list[int]] = []
        top_values: list[list[float]] = []
        if most:
            top = torch.topk(logp, most, dim=-1)
            top_ids, top_values = top.indices.tolist(), top.values.tolist()
        targets = plan.target_ids
        spans: dict[str, PromptSpan] = {}
        row = 0
        for request_id, first, count, k in plan.spans:
            spans[request_id] = (first, [
                TokenLogprob(targets[r], chosen[r],
                             list(zip(top_ids[r][:k], top_values[r][:k], strict=True))
                             if k else [])
                for r in range(row, row + count)])
            row += count
        return spans
