"""`conveyor gateway`: an OpenAI-compatible HTTP front for the fleet (stateless: run many).

Needs the ``gateway`` extra (Starlette, uvicorn). docs/gateway.md describes the endpoints,
their errors and what is not supported.
"""

from producer.gateway.app import create_app
from producer.gateway.settings import GatewaySettings

__all__ = ["GatewaySettings", "create_app"]
