"""The producer side of conveyor: request types, the wire protocol and clients. No torch."""

from producer.backpressure import QueueFull
from producer.completion import Completion, FinishReason, TokenLogprob, Usage
from producer.params import SamplingParams

__all__ = ["Completion", "FinishReason", "QueueFull", "SamplingParams", "TokenLogprob", "Usage"]
