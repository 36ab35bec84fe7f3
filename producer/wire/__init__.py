"""Types both sides of the wire share: requests, parameters, completions, keys, validation.

Imports neither redis nor torch (checked by tests/test_layering.py): the scheduler, the
KV bookkeeping, producers and workers all build on it.
"""

from producer.wire.completion import Completion, FinishReason, TokenLogprob, Usage
from producer.wire.errors import LaneBlocked, ModelNotFound, QueueFull
from producer.wire.keys import GROUP, LANES, Keys
from producer.wire.params import SamplingParams
from producer.wire.protocol import FinalEntry, GenerationRequest, OutputChunk, ProtocolError

__all__ = [
    "GROUP",
    "LANES",
    "Completion",
    "FinalEntry",
    "FinishReason",
    "GenerationRequest",
    "Keys",
    "LaneBlocked",
    "ModelNotFound",
    "OutputChunk",
    "ProtocolError",
    "QueueFull",
    "SamplingParams",
    "TokenLogprob",
    "Usage",
]
