"""OpenAI's response shapes, built from conveyor's completions and stream events.

``finish_reason`` is OpenAI's ``stop`` or ``length`` for requests that ended normally;
conveyor's own ``cancelled`` (a cancel, or the client went away) and ``expired`` (past the
request's deadline) pass through as they are (docs/gateway.md). A request that failed
(``error``) is answered with an error instead of a choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from producer.openai_api import ApiRequest
from producer.wire.completion import Completion, TokenLogprob, Usage

# Token id -> its text, for logprobs (the model's tokenizer; None when it has none).
TokenText = Callable[[int], str]


def response_id(request: ApiRequest, request_id: str) -> str:
    return ("chatcmpl-" if request.chat else "cmpl-") + request_id


def usage_body(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def completion_body(request: ApiRequest, done: Completion, created: int,
                    token_text: TokenText | None) -> dict[str, Any]:
    """The whole answer of a request that was not streamed."""
    logprobs = logprobs_body(request, done.logprobs, token_text, 0)
    if request.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": done.text},
                  "logprobs": logprobs, "finish_reason": str(done.finish_reason)}
    else:
        choice = {"index": 0, "text": done.text, "logprobs": logprobs,
                  "finish_reason": str(done.finish_reason)}
    return {"id": response_id(request, done.request_id),
            "object": "chat.completion" if request.chat else "text_completion",
            "created": created, "model": request.model, "choices": [choice],
            "usage": usage_body(done.usage)}


class ChunkWriter:
    """The chunks of one streamed answer, in order."""

    def __init__(self, request: ApiRequest, request_id: str, created: int,
                 token_text: TokenText | None) -> None:
        self.request = request
        self.id = response_id(request, request_id)
        self.created = created
        self.token_text = token_text
        self.text_offset = 0  # completions' logprobs name each token's offset in the text

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.request.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.request.model, "choices": choices, **extra}

    def first(self) -> dict[str, Any] | None:
        """Chat opens with the assistant's role and no content; completions with nothing."""
        if not self.request.chat:
            return None
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def text(self, text: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        lp = logprobs_body(self.request, logprobs, self.token_text, self.text_offset)
        self.text_offset += len(text)
        if self.request.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": lp,
                      "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": None}
        return self._chunk([choice])

    def last(self, finish_reason: str, text: str = "") -> dict[str, Any]:
        if self.request.chat:
            delta = {"content": text} if text else {}
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": finish_reason}
        return self._chunk([choice])

    def usage(self, usage: Usage) -> dict[str, Any]:
        """stream_options.include_usage: a last chunk with the usage and no choices."""
        return self._chunk([], usage=usage_body(usage))


def logprobs_body(request: ApiRequest, logprobs: list[TokenLogprob] | None,
                  token_text: TokenText | None, text_offset: int) -> dict[str, Any] | None:
    """Logprobs in the answer's shape (chat's ``content`` list, or completions' four lists)."""
    if not request.logprobs or logprobs is None:
        return None
    text = token_text or (lambda t: f"<{t}>")
    if request.chat:
        return {"content": [
            {"token": text(lp.token_id), "logprob": lp.logprob,
             "bytes": list(text(lp.token_id).encode()),
             "top_logprobs": [{"token": text(t), "logprob": a, "bytes": list(text(t).encode())}
                              for t, a in lp.top]}
            for lp in logprobs]}
    tokens = [text(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{text(t): a for t, a in lp.top} for lp in logprobs],
            "text_offset": offsets}
