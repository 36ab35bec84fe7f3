"""The producer side of conveyor: the wire types, clients and bulk jobs. Never imports torch.

``import producer`` loads only the shared wire types (producer.wire); the clients
(producer.client.client, producer.client.async_client) load redis when imported.
"""

from producer.wire import Completion, FinishReason, QueueFull, SamplingParams, TokenLogprob, Usage

__all__ = ["Completion", "FinishReason", "QueueFull", "SamplingParams", "TokenLogprob", "Usage"]
