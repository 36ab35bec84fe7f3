"""The client side of the wire: submit requests, follow their output streams, cancel them.

``Client`` (synchronous) and ``AsyncClient`` (asyncio) share the I/O-free parts in
``client.py``; ``connection`` opens Redis connections (the embedded server by default),
``backpressure`` refuses work past a queue limit, ``models`` reads which models are served,
``queues`` reads how full each lane is, ``stream_events``/``stream_follow`` turn output
entries into events. Loads redis, never torch.
"""

from producer.client.async_client import AsyncClient
from producer.client.backpressure import QueueFull
from producer.client.client import Client, Submission
from producer.client.models import ModelState
from producer.client.stream_events import StreamGapError
from producer.wire.errors import LaneBlocked, ModelNotFound

__all__ = ["AsyncClient", "Client", "LaneBlocked", "ModelNotFound", "ModelState", "QueueFull",
           "StreamGapError", "Submission"]
