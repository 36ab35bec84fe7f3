"""Per-request output bookkeeping in the engine: text deltas, stop strings, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from producer.wire.completion import Completion, FinishReason, TokenLogprob, Usage
from producer.wire.params import SamplingParams
from worker.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    # Text that became final this step (stop strings removed, partial matches held back).
    text_delta: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    # Set on the last output of a request.
    completion: Completion | None = None
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    # On the request's first output, when it asked for prompt logprobs: its prompt's ids
    # and, per token, its logprob (None for the first).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def merged_outputs(outputs: list[StepOutput]) -> StepOutput:
    """Several outputs of one request as one (the last one's ending)."""
    last = outputs[-1]
    logprobs = [lp for o in outputs for lp in (o.logprobs or [])]
    first = outputs[0]
    return StepOutput(last.request_id, [t for o in outputs for t in o.new_token_ids],
                      "".join(o.text_delta for o in outputs), last.finished,
                      last.finish_reason, logprobs or None, last.completion,
                      last.num_cached_tokens, first.prompt_token_ids, first.prompt_logprobs)


@dataclass(slots=True)
class RequestOutputState:
    """Everything the engine accumulates for a request besides its KV."""

    request_id: str
    params: SamplingParams
    seed: int
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""  # text so far, cut at a stop string once one is found
    emitted: int = 0  # characters of text already handed out
    hit_stop_string: bool = False
    num_cached_tokens: int = 0
    # Tokens whose KV was imported from the fleet tier when the request was added.
    num_transferred_tokens: int = 0
    # Of a request that wants prompt logprobs (and has no output yet): its prompt, and the
    # logprobs of its first len(prompt_logprobs) tokens so far (None for the first).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Why the request failed, of one that ends with an error.
    error: str | None = None

    @classmethod
    def create(cls, request_id: str, params: SamplingParams, seed: int, num_prompt_tokens: int,
               tokenizer: Tokenizer | None, prompt_token_ids: list[int] | None = None,
               ) -> RequestOutputState:
        """``prompt_token_ids``: the prompt, where its logprobs are still to come (not a
        resumed request's: its first output, with them, was out before)."""
        detok = (IncrementalDetokenizer(tokenizer,
                                        skip_special_tokens=params.skip_special_tokens)
                 if tokenizer is not None else None)
        state = cls(request_id, params, seed, num_prompt_tokens, detok)
        if params.prompt_logprobs is not None and prompt_token_ids is not None:
            state.prompt_token_ids = list(prompt_token_ids)
            state.prompt_logprobs = [None]
        return state

    def add_prompt_logprobs(self, first: int, span: list[TokenLogprob]) -> None:
        """Take in the logprobs of prompt positions ``first ..``, in order; positions it has
        already (a prompt computed again after a preemption) are kept as they were."""
        have = self.prompt_logprobs
        if have is None:
            return
        skip = len(have) - first
        if skip >= 0:
            have.extend(span[skip:])

    def opening(self) -> tuple[list[int], list[TokenLogprob | None]] | None:
        """Before the request's first output token is added: its prompt and the prompt's
        logprobs, when it asked for them; None otherwise."""
        if self.prompt_logprobs is None or self.token_ids:
            return None
        return self.prompt_token_ids or [], self.prompt_logprobs

    def add_tokens(self, token_ids: list[int], logprob: TokenLogprob | None) -> None:
        """Record new tokens; sets hit_stop_string when the text now contains a stop string."""
        self.token_ids.extend(token_ids)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.detokenizer is None or self.hit_stop_string:
            return
        if not self.params.stop:  # most requests: nothing to look for, every step
            self.text += self.detokenizer.add(token_ids)
            return
        start = max(0, len(self.text) - self._longest_stop() + 1)
        self.text += self.detokenizer.add(token_ids)
        if len(self.token_ids) >= self.params.min_tokens:  # none ends it before min_tokens
            self._cut_at_stop_string(start)

    def finish_text(self) -> None:
        """Release text held back in the detokenizer once the request ends."""
        if self.detokenizer is not None and not self.hit_stop_string:
            start = max(0, len(self.text) - self._longest_stop() + 1)
            self.text += self.detokenizer.flush()
            if len(self.token_ids) >= self.params.min_tokens:
                self._cut_at_stop_string(start)

    def take_delta(self, final: bool) -> str:
        """Text not yet emitted, holding back a tail that may still become a stop string."""
        hold_nothing = final or self.hit_stop_string or not self.params.stop
        end = len(self.text) if hold_nothing else self._safe_end()
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta

    def completion(self, reason: FinishReason, num_cached_tokens: int = 0) -> Completion:
        return Completion(
            request_id=self.request_id,
            token_ids=list(self.token_ids),
            text=self.text,
            finish_reason=reason,
            usage=Usage(self.num_prompt_tokens, len(self.token_ids), num_cached_tokens,
                        min(self.num_transferred_tokens, self.num_prompt_tokens)),
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            error=self.error,
        )

    def _longest_stop(self) -> int:
        return max((len(s) for s in self.params.stop), default=1)

    def _cut_at_stop_string(self, start: int) -> None:
        hits = [(i, len(s)) for s in self.params.stop if (i := self.text.find(s, start)) != -1]
        if hits:
            if self.params.include_stop_str_in_output:
                # The text ends with the stop string that was complete first.
                self.text = self.text[: min(i + n for i, n in hits)]
            else:
                self.text = self.text[: min(i for i, _ in hits)]
            self.hit_stop_string = True

    def _safe_end(self) -> int:
        # The longest tail of the text that is a proper prefix of some stop string.
        held = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return len(self.text) - held


# A step's prompt logprobs by request: (first prompt position, one logprob a position).
PromptSpans = dict[str, tuple[int, list[TokenLogprob]]]


def add_prompt_spans(states: dict[str, RequestOutputState], spans: PromptSpans) -> None:
    """A step's spans of prompt logprobs (worker/sampling/prompt_logprobs.py), each to its
    request's state (one that ended meanwhile has none)."""
    for request_id, (first, span) in spans.items():
        if (state := states.get(request_id)) is not None:
            state.add_prompt_logprobs(first, span)
