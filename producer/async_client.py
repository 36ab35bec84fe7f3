"""Compatibility: ``producer.async_client.AsyncClient`` is ``producer.client.AsyncClient``.

The one compatibility module of the house (docs/architecture.md, "Compatibility").
"""

from producer.client.async_client import AsyncClient

__all__ = ["AsyncClient"]
