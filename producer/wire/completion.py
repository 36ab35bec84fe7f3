"""What a finished request returns, on both sides of the wire."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class FinishReason(StrEnum):
    """Why a request stopped producing tokens."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's max length
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # past its deadline
    ERROR = "error"


@dataclass
class Usage:
    """Token accounting of one request."""

    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens whose KV came from the prefix cache instead of being computed.
    cached_tokens: int = 0
    # Prompt tokens whose KV arrived from the fleet KV tier (a handoff, a fleet prefix hit).
    kv_transferred_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Completion:
    """The whole result of one request."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    # Of a request that asked for prompt logprobs: its prompt's token ids and, per token,
    # its logprob given the ones before it (None for the first, which has none before it).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": str(self.finish_reason),
            "usage": {
                "prompt_tokens": self.usage.prompt_tokens,
                "completion_tokens": self.usage.completion_tokens,
                "cached_tokens": self.usage.cached_tokens,
            },
            "error": self.error,
        }
