"""The messages a fleet worker's threads hand each other, in one place.

intake → engine loop (the inbox): ``Admission``.
engine loop, intake and reaper → publisher (``Publisher.publish``): ``Publication``
(a step's output), ``Rejection`` (an entry that cannot be served), ``HandOn`` (a prefill
worker's request for the decode workers), ``SharePrefix`` (prompt blocks for the KV tier),
``Track`` and ``Forget`` (start and stop the publisher's text state of a request).
Plain data, never pickled: they stay inside one process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.handoff import KVHandoff
from producer.wire.params import SamplingParams
from producer.wire.protocol import FinalEntry, GenerationRequest, OutputChunk
from worker.fleet.intake.resume import Published


@dataclass
class Admission:
    """A decoded, tokenized request on its way to the engine loop."""

    # The request as the producer sent it, decoded and validated.
    request: GenerationRequest
    # Its prompt as token ids (text encoded, chat messages rendered).
    prompt_token_ids: list[int]
    # The request stream and entry it was read from (acknowledged once it ends).
    stream: str
    entry_id: str
    # What an earlier worker already published (a claimed request resumes after it).
    published: Published | None = None
    # KV of its first tokens from the fleet tier, if usable.
    kv: KVHandoff | None = None
    # Where that KV came from: "handoff" (a prefill worker), "prefix" (fleet prefix
    # reuse), "" when there is none.
    kv_source: str = ""
    # Until it is fetched: what fetches its KV from the tier (never raising for the
    # tier), and the source it would be; None once fetched or where none is wanted.
    kv_fetch: Callable[[], KVHandoff | None] | None = field(default=None, repr=False)
    kv_fetch_source: str = ""


@dataclass(slots=True)
class Publication:
    """Output of one request in one step: a chunk, a final entry, or both (the publisher
    writes it; worker/fleet/publishing/chunk_holder.py may join several into one)."""

    # Whose output stream it goes to.
    request_id: str
    # Tokens of this step (text is filled in on the publisher thread).
    chunk: OutputChunk | None = None
    # The request ended: its final entry.
    final: FinalEntry | None = None
    # (request stream, entry id) to acknowledge once the final entry is written.
    ack: tuple[str, str] | None = None
    # Prompt tokens served from the prefix cache so far (for a final made by a stop string).
    cached_tokens: int = 0
    # Progress across retries: every entry is in Redis.
    written: bool = False
    # Progress across retries: the final was there before our XADD.
    final_existed: bool = False
    # The engine loop held its tokens for the stream interval already
    # (worker/fleet/publishing/token_hold.py): the chunk holder passes it on as it is.
    coalesced: bool = False


@dataclass
class Rejection:
    """A request entry that cannot be served: dead-lettered, answered when possible, acked."""

    # The request stream and entry to dead-letter and acknowledge.
    stream: str
    entry_id: str
    # Why, for the dead letter and the error final.
    reason: str
    # Whose output stream gets the error final (None: the entry named no valid id).
    request_id: str | None = None
    # The entry as it arrived, kept (bounded) in the dead letter.
    raw: bytes | None = None
    # False when another request with this id is live: its stream must not get our error.
    write_final: bool = True
    # Tokens already on the request's output stream (the error final goes after them),
    # and where this worker's entry ids start (a request it took over: resume.py).
    num_tokens: int = 0
    id_base: int = 0
    # Progress across retries: the error final is written.
    written: bool = False
    # Progress across retries (a dead letter has no fixed id: it must not be added twice).
    dead_lettered: bool = False


@dataclass
class HandOn:
    """A request this prefill worker computed the prompt of, to hand on to the decode
    workers (worker/fleet/handoff/handoff.py writes it)."""

    request_id: str
    # The lane entry to acknowledge as the handoff entry is added.
    stream: str
    entry_id: str
    # The request as the producer sent it, added to the handoff stream as it is.
    message: bytes
    # The stream field the message goes in.
    field: str
    # The KV of the request's computed tokens, for the tier (None: a simulated engine's,
    # which has none; handed on without KV).
    kv: KVHandoff | None
    # Of the token ids the KV covers: a reader checks its own tokens against it.
    tokens_hash: str = ""
    # Progress across retries: handed on (or found no longer this worker's).
    written: bool = False


@dataclass
class SharePrefix:
    """Full prompt blocks of a request to put in the KV tier (fleet prefix reuse)."""

    # Whose prompt they are (for logs).
    request_id: str
    # (chain hash, bytes) of each block, in prompt order.
    blocks: list[tuple[bytes, bytes]]
    # Progress across retries: put (or refused) already.
    written: bool = False


@dataclass
class Track:
    """Start following a request's text: its parameters and where its entry came from."""

    request_id: str
    # Its stop strings and logprobs settings decide the text and the final.
    params: SamplingParams
    num_prompt_tokens: int
    # (request stream, entry id) acknowledged with a final a stop string makes; None for a
    # choice of several (the engine's final of the last choice to end acknowledges it).
    ack: tuple[str, str] | None
    # A resumed request: the tokens an earlier worker already published.
    published_token_ids: list[int] | None = None
    # ... and their text, as its stream holds it.
    published_text: str = ""


@dataclass(slots=True)
class Forget:
    """Stop following a request without a final (another worker owns it now)."""

    request_id: str


# What the publisher's queue takes.
PublisherItem = Publication | Rejection | HandOn | SharePrefix | Track | Forget
