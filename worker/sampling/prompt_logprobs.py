"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and the
most likely alternatives there, computed in the prefill that runs anyway.

The logits at position p predict the token at p + 1, so a prefill chunk over positions
[s, s + n) gives the prompt's tokens s + 1 .. s + n their logprobs (the prompt's last
position predicts the first output token: that row is the sampler's). A step with such a
chunk keeps its hidden states and projects them to logits ROWS_PER_BLOCK rows at a time
(a chunk of thousands of rows over a vocabulary of 150,000 would otherwise hold gigabytes of
logits at once); the sampler's rows are projected on their own. The chunks of a chunked
prefill come in order, each adding its span. A request whose prompt is computed again
(preempted before its first token) gives the same span again; the engine keeps the first.

Logprobs are computed in the logits' dtype (float64 on a float64 model, never rounded
through float32); bfloat16 and float16 logits are widened to float32 first.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from producer.wire.completion import TokenLogprob
from producer.wire.params import SamplingParams
from worker.host.step_upload import Staged, StepUpload

# One request's span of prompt logprobs from one step: (the first prompt position it gives
# a logprob to, one TokenLogprob per position from there).
PromptSpan = tuple[int, list[TokenLogprob]]
# Rows projected to logits at once: 256 x a 150,000-token vocabulary is ~150 MB in float32.
ROWS_PER_BLOCK = 256


@dataclass
class PromptPlan:
    """What a step with prompt-logprob chunks computes: the rows (of the step's tokens)
    whose logits give prompt logprobs, the prompt token each is read at, and the rows the
    sampler reads (each sampling chunk's last)."""

    rows: Staged
    targets: Staged
    target_ids: list[int]
    sample_rows: Staged | None
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
        rows: list[int] = []
        targets: list[int] = []
        sample_rows: list[int] = []
        spans = []
        offset = 0
        for c in chunks:
            n = c.num_tokens
            if c.sample:
                sample_rows.append(offset + n - 1)
            wanted = self._wanted.get(c.request_id)
            if wanted is not None:
                k, prompt = wanted
                start = c.start_position
                count = max(0, min(start + n, len(prompt) - 1) - start)
                if start + n >= len(prompt) - 1:  # its last span: wanted no more
                    del self._wanted[c.request_id]
                if count:
                    rows.extend(range(offset, offset + count))
                    targets.extend(prompt[start + 1:start + 1 + count])
                    spans.append((c.request_id, start + 1, count, k))
            offset += n
        if not spans:
            return None
        stage = lambda values: upload.add(np.asarray(values, dtype=np.int64))  # noqa: E731
        return PromptPlan(stage(rows), stage(targets), targets,
                          stage(sample_rows) if sample_rows else None, spans)

    @staticmethod
    def compute(project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                plan: PromptPlan) -> dict[str, PromptSpan]:
        """Each span's logprobs: ``project`` (the model's hidden-to-logits) applied to the
        plan's rows of ``hidden``, ROWS_PER_BLOCK at a time."""
        most = max(k for *_, k in plan.spans)
        chosen: list[float] = []
        top_ids: list[list[int]] = []
        top_values: list[list[float]] = []
        rows, targets = plan.rows.tensor, plan.targets.tensor
        for begin in range(0, len(plan.target_ids), ROWS_PER_BLOCK):
            x = project(hidden.index_select(0, rows[begin:begin + ROWS_PER_BLOCK]))
            if x.dtype not in (torch.float32, torch.float64):
                x = x.float()
            logp = torch.log_softmax(x, dim=-1)
            at = targets[begin:begin + ROWS_PER_BLOCK, None]
            chosen += logp.gather(1, at).squeeze(1).tolist()
            if most:
                top = torch.topk(logp, most, dim=-1)
                top_ids += top.indices.tolist()
                top_values += top.values.tolist()
        spans: dict[str, PromptSpan] = {}
        row = 0
        for request_id, first, count, k in plan.spans:
            spans[request_id] = (first, [
                TokenLogprob(plan.target_ids[r], chosen[r],
                             list(zip(top_ids[r][:k], top_values[r][:k], strict=True))
                             if k else [])
                for r in range(row, row + count)])
            row += count
        return spans
