"""What the engine loop hands the publisher for one request in one step (publisher.py
writes it; worker/fleet/publishing/chunk_holder.py may join several into one)."""

from __future__ import annotations

from dataclasses import dataclass

from producer.wire.protocol import FinalEntry, OutputChunk


@dataclass
class Publication:
    """Output of one request in one step: a chunk, a final entry, or both."""

    request_id: str
    chunk: OutputChunk | None = None
    final: FinalEntry | None = None
    # (request stream, entry id) to acknowledge once the final entry is written.
    ack: tuple[str, str] | None = None
    # Prompt tokens served from the prefix cache so far (for a final made by a stop string).
    cached_tokens: int = 0
    # Progress across retries: every entry is in Redis; the final was there before our XADD.
    written: bool = False
    final_existed: bool = False
    # A chunk joined from several steps' chunks (worker/fleet/publishing/chunk_holder.py): those, in
    # order, written one by one where the stream does not end right before the joined one.
    pieces: list[OutputChunk] | None = None
