"""Turn one row of logits per request into the next token: greedy or filtered sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from producer.wire.completion import TokenLogprob
from producer.wire.params import SamplingParams
from worker.sampling.randomness import uniform


@dataclass
class SampleRequest:
    """One row to sample: its parameters, seed and the output index being drawn."""

    params: SamplingParams
    seed: int
    output_index: int


class Sampler:
    """Picks tokens row by row, so a row's result never depends on its neighbours."""

    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRequest]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Returns the chosen token per row and, where asked for, its logprobs."""
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        tokens = [0] * len(rows)
        if greedy:
            # argmax breaks ties by the lowest id, as the reference implementation does.
            picks = logits[greedy].argmax(dim=-1).tolist()
            for i, t in zip(greedy, picks, strict=True):
                tokens[i] = t
        if sampled:
            picks = self._sample(logits[sampled].float(), [rows[i] for i in sampled])
            for i, t in zip(sampled, picks, strict=True):
                tokens[i] = t
        return tokens, self._logprobs(logits, rows, tokens)

    def _sample(self, logits: torch.Tensor, rows: list[SampleRequest]) -> list[int]:
        vocab = logits.shape[-1]
        temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)
        sorted_logits, sorted_ids = torch.sort(logits / temps[:, None], dim=-1, descending=True,
                                               stable=True)
        ranks = torch.arange(vocab)
        top_k = torch.tensor([r.params.top_k or vocab for r in rows])
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # top_p keeps the smallest prefix whose mass reaches p (the top token always stays).
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=probs.dtype)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill((mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0), 0.0)
        # min_p drops tokens less likely than min_p times the most likely one.
        min_p = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype)
        probs = probs.masked_fill(probs < (min_p * probs[:, 0])[:, None], 0.0)
        cdf = torch.cumsum(probs, dim=-1)
        draws = torch.tensor(
            [uniform(r.seed, r.output_index) for r in rows], dtype=cdf.dtype
        ) * cdf[:, -1]
        picks = torch.searchsorted(cdf, draws[:, None], right=True).clamp_(max=vocab - 1)
        return sorted_ids.gather(1, picks).squeeze(1).tolist()

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, rows: list[SampleRequest], tokens: list[int]
    ) -> list[TokenLogprob | None]:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(rows)
        if not wanted:
            return result
        # Logprobs of the model's own distribution, before temperature and filters.
        logp = torch.log_softmax(logits[wanted].float(), dim=-1)
        for row, i in enumerate(wanted):
            n = rows[i].params.logprobs or 0
            top = torch.topk(logp[row], n) if n else None
            result[i] = TokenLogprob(
                token_id=tokens[i],
                logprob=float(logp[row, tokens[i]]),
                top=(list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                     if top else []),
            )
        return result
