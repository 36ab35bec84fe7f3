"""The producer side of conveyor: request types and (later) the Redis client. Never imports torch."""

from producer.completion import Completion, FinishReason, TokenLogprob, Usage
from producer.params import SamplingParams

__all__ = ["Completion", "FinishReason", "SamplingParams", "TokenLogprob", "Usage"]
