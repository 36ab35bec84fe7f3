"""One request as the scheduler sees it: token ids, progress and state. No torch, no redis."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvstore.kv_manager import PrefixHit
from producer.wire.completion import FinishReason
from producer.wire.params import SamplingParams


class RequestStatus(Enum):
    """The request life cycle (see docs/architecture.md)."""

    WAITING = "waiting"  # queued, holds no KV
    RUNNING_CTX = "running_ctx"  # catching its KV up to its tokens (prefill, maybe in chunks)
    RUNNING_GEN = "running_gen"  # one new token a step
    PREEMPTED = "preempted"  # evicted under memory pressure: KV swapped to host, or dropped
    FINISHED = "finished"

    @property
    def running(self) -> bool:
        return self in (RequestStatus.RUNNING_CTX, RequestStatus.RUNNING_GEN)


@dataclass(eq=False)
class Request:
    """A request's tokens and how far its KV has been computed.

    Prefill, chunked prefill and resumption are one thing: each step catches
    ``num_computed_tokens`` up towards ``num_tokens``. When it gets there a new
    token is sampled and appended, and the gap is one again.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    # Lower is more urgent; ties go to the earlier arrival.
    priority: int = 0
    # Monotonic order of arrival, assigned by the scheduler.
    arrival: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # How its tokens are picked and the seed of its draws: the scheduler only hands them to
    # the runner (NewRequestData) when the request gets a table of its own.
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    # Tokens generated so far; a resumed request starts with the ones already published.
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Times it was preempted; the engine's counters add these up.
    num_preemptions: int = 0
    # How its KV left the device when preempted: "swap" (to host) or "recompute" (dropped).
    preempted_by: str | None = None
    # Prompt tokens whose KV came from the prefix cache at its first admission.
    num_cached_tokens: int = 0
    admitted_once: bool = False
    # Prefix-cache hashes of its full blocks so far (prompt, then output), each computed
    # once in the request's life: kept across waiting, swaps and recomputation.
    block_hashes: list[bytes] = field(default_factory=list)
    # Entries of its block table already handed to the runner (0 after a preemption: the
    # next chunk carries the whole table).
    num_blocks_sent: int = 0
    # KV of its first tokens that arrived from the fleet tier, held until admission adopts
    # it (kvstore.KVCacheManager.hold_blocks); None once adopted, or when there was none.
    preloaded: PrefixHit | None = None
    # Tokens whose imported KV it adopted at admission (usage.kv_transferred_tokens).
    num_transferred_tokens: int = 0
    # Overlapped steps (Scheduler.advance): the newest output token is PENDING_TOKEN, sampled
    # by a step still running; and, when that token reaches a length limit, the request is
    # not scheduled again (it finishes once the token is known).
    pending_token: bool = False
    finishing: bool = False
    # Set by the scheduler when the request is added (Scheduler.add_request): the tokens
    # that end it (stop tokens, and EOS unless ignored) and how many output tokens it may
    # have (max_tokens, or fewer where the model's length comes first). Checked for every
    # request every step: one set lookup and one comparison (producer.wire.stopping's rules).
    stop_ids: frozenset[int] = frozenset()
    output_limit: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Token ids at positions ``start .. stop - 1`` of prompt + output."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def urgency_key(self) -> tuple[int, int]:
        """Sort key: smallest is served first."""
        return (self.priority, self.arrival)
