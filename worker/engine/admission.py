"""Admitting a request to the engine: its parameters, prompt and lengths checked, and how
many tokens it may generate. Each check raises ValueError before the engine changes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore import blocks_for
from producer.wire.params import SamplingParams
from producer.wire.protocol import check_prompt_logprobs_size
from producer.wire.stopping import token_limit
from producer.wire.validation import validate_token_ids
from worker.engine.tokenizer import Tokenizer
from worker.sampling.grammar import Grammars

Prompt = str | Sequence[int]


def sampling_params(params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    """The request's SamplingParams from themselves, a mapping, or None (the defaults)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, Mapping):
        return SamplingParams.from_dict(params)
    raise ValueError(f"params must be SamplingParams or a mapping, got {type(params).__name__}")


def prompts_and_params(prompts: Prompt | Sequence[Prompt], params: Any
                       ) -> list[tuple[Prompt, Any]]:
    """Engine.generate's prompts, each with its params: one for all, or one each."""
    if isinstance(prompts, str):
        prompts = [prompts]
    single = params is None or isinstance(params, SamplingParams | Mapping)
    per_prompt = [params] * len(prompts) if single else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
    return list(zip(prompts, per_prompt, strict=True))


@dataclass(frozen=True)
class AdmissionChecks:
    """What a request must fit to be admitted to one engine."""

    tokenizer: Tokenizer | None
    vocab_size: int
    # Longest prompt + output.
    max_model_len: int
    block_size: int
    # Blocks of the device KV pool: a request that needs more can never run.
    num_kv_blocks: int
    # A simulated engine (no logits: no logprobs).
    simulated: bool = False
    # The model's grammars (worker/sampling/grammar.py); None: no response_format.
    grammars: Grammars | None = None

    @classmethod
    def of(cls, model_dir: Any, tokenizer: Tokenizer | None, mc: Any, max_model_len: int,
           block_size: int, num_kv_blocks: int, simulated: bool) -> AdmissionChecks:
        """The checks of an engine of the model ``mc`` read from ``model_dir``, its grammars
        made where it can follow them (a tokenizer.json, not simulated)."""
        grammars = None if simulated else Grammars.for_model(model_dir, mc.vocab_size,
                                                             mc.eos_token_ids)
        return cls(tokenizer, mc.vocab_size, max_model_len, block_size, num_kv_blocks,
                   simulated, grammars)

    def grammar_stats(self) -> dict[str, float]:
        """The grammars' counters (worker/sampling/grammar.py); none without grammars."""
        return self.grammars.stats() if self.grammars is not None else {}

    @property
    def kv_pool_tokens(self) -> int:
        """Tokens the whole device KV pool holds."""
        return self.num_kv_blocks * self.block_size

    def admit(self, prompt: Prompt, params: SamplingParams, generated: Sequence[int],
              preloaded: bool = False) -> tuple[list[int], list[int], int]:
        """(prompt ids, generated ids, token limit) of a request every check passed;
        ``preloaded``: its first tokens' KV comes from another engine."""
        self.check_params(params)
        prompt_ids = self.prompt_ids(prompt)
        if params.response_format is not None:  # (refused here, never by the runner)
            assert self.grammars is not None  # (check_params refused it otherwise)
            if generated:  # a resumed request: its tokens must replay in the grammar
                self.grammars.matcher(params.response_format, self.generated_ids(generated))
            else:
                self.grammars.compile(params.response_format)
        if params.prompt_logprobs is not None and not generated:
            self.check_prompt_logprobs(len(prompt_ids), params.prompt_logprobs, preloaded)
        self.check_logit_bias(params)
        generated_ids = self.generated_ids(generated)
        limit = self.token_limit(len(prompt_ids), params)
        self.check_lengths(prompt_ids, generated_ids, limit)
        return prompt_ids, generated_ids, limit

    def check_params(self, params: SamplingParams) -> None:
        """What the engine cannot serve of ``params``, whatever the prompt."""
        if self.simulated and (params.logprobs is not None
                               or params.prompt_logprobs is not None):
            raise ValueError("logprobs: this worker is simulated (no forward, no logits): it "
                             "cannot give log-probabilities")
        if params.response_format is not None and (self.simulated or self.grammars is None):
            raise ValueError("response_format: " + (
                "this worker is simulated (its tokens are not the model's): it cannot follow "
                "a grammar" if self.simulated else "this model has no tokenizer.json"))
        if params.n != 1:
            raise ValueError(f"n={params.n}: the engine serves one choice a request; add one "
                             "request a choice, seeded seed + i (the fleet's workers do so: "
                             "producer.wire.params.choice_params)")

    @staticmethod
    def check_prompt_logprobs(num_tokens: int, k: int, preloaded: bool) -> None:
        """Prompt logprobs are made in the prefill and travel in the first chunk: the whole
        prompt is computed, and they must fit in one stream entry."""
        if preloaded:
            raise ValueError("prompt_logprobs: the prompt's KV comes from another engine, so "
                             "its logprobs are not computed here; add it without that KV")
        check_prompt_logprobs_size(num_tokens, k)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids (a string is encoded), each checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass the prompt as token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            prompt = self.tokenizer.encode(prompt)
        return validate_token_ids(prompt, self.vocab_size)

    def generated_ids(self, generated: Sequence[int]) -> list[int]:
        """Tokens a resumed request already produced, checked against the vocabulary."""
        return (validate_token_ids(list(generated), self.vocab_size, "generated_token_ids")
                if generated else [])

    def check_logit_bias(self, params: SamplingParams) -> None:
        if any(token >= self.vocab_size for token, _ in params.logit_bias):
            raise ValueError("logit_bias names a token id outside the vocabulary "
                             f"[0, {self.vocab_size})")

    def token_limit(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Most tokens the request may generate (producer.wire.stopping.token_limit, the
        rule the fleet's engine loop applies to a resumed request too)."""
        return token_limit(params.max_tokens, num_prompt_tokens,
                           max_model_len=self.max_model_len, kv_pool_tokens=self.kv_pool_tokens)

    def check_lengths(self, prompt: list[int], generated: list[int], limit: int) -> None:
        """Refuse a request that leaves no room to generate, is done already, or needs more
        KV than the whole pool holds (it would wait for blocks that cannot exist)."""
        n = len(prompt) + len(generated)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt of {n} tokens leaves no room to generate: the model's max length is "
                f"{self.max_model_len} tokens"
            )
        if len(generated) >= limit:
            raise ValueError(f"already {len(generated)} generated tokens, max_tokens is "
                             f"{limit}")
        peak = min(len(prompt) + limit, self.max_model_len)
        if blocks_for(peak, self.block_size) > self.num_kv_blocks:
            raise ValueError(
                f"request needs up to {peak} tokens of KV, more than the whole KV pool "
                f"({self.num_kv_blocks} blocks of {self.block_size})"
            )
