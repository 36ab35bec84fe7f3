"""What one scheduling step hands to the model runner: plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from producer.wire.params import SamplingParams

# Stands for a token that a step still running samples (overlapped scheduling): the runner
# feeds the real one, known by the time the next step computes.
PENDING_TOKEN = -1


@dataclass(slots=True)
class ScheduledChunk:
    """The tokens of one request computed in this step."""

    request_id: str
    # Token ids fed to the model this step (a prefill chunk, or the one newest token).
    token_ids: list[int]
    # Position of token_ids[0]: the tokens before it are already in the KV cache.
    start_position: int
    # Blocks the request gained since the runner last heard of it, in order. The runner
    # keeps each request's table across steps: it appends these after its first
    # ``num_known_blocks`` entries (0: a table of its own from here on, after admission,
    # swap-in or recomputation). Together they cover start_position + len(token_ids).
    new_block_ids: list[int]
    num_known_blocks: int
    # True when the chunk reaches the request's last known token, so a token is sampled.
    sample: bool
    # Index in the output of the token sampled from this chunk (seeds sampling randomness).
    output_index: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.sample


@dataclass(slots=True)
class NewRequestData:
    """What the runner keeps of a request while it runs, sent once: in the step that gives
    it a table of its own (admission, swap-in, resumption after recompute). The runner
    forgets it when the request finishes or is preempted, as it forgets its block table."""

    request_id: str
    # How its tokens are picked; its draws are a pure function of (seed, output index).
    sampling_params: SamplingParams
    seed: int
    # Its prompt (never changed) and a copy of its output so far: penalties count them,
    # and the runner adds each token it samples for the request from here on.
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SchedulerOutput:
    """Everything the runner computes in one step, decodes first."""

    # One entry per scheduled request, decodes first, then prefill chunks.
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Requests the runner has no state for, among this step's chunks (their chunks have
    # num_known_blocks 0): their sampling state, once.
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Requests preempted during this step's scheduling (swapped out or dropped).
    preempted_ids: list[str] = field(default_factory=list)
    # Requests that ended since the previous step (the runner forgets their tables).
    finished_ids: list[str] = field(default_factory=list)
    # KV copies the runner makes before the forward pass, swap-outs first:
    # (device block, host block) pairs to save, then (host block, device block) to restore.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Scheduled without preemption (overlapped), and a running request did not fit: the
    # next step is scheduled with the previous one finished, so it may preempt.
    starved: bool = False
    # Set by Scheduler.advance: each chunk's request as it was then (None: it had ended),
    # so that resolve never applies a step to a later request that reuses the id.
    advanced: list = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and nothing to copy."""
        return not (self.chunks or self.swap_out or self.swap_in)


@dataclass(slots=True)
class RequestUpdate:
    """What a step did to one request: the tokens it gained and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    # Prompt tokens served from the prefix cache (for usage).
    num_cached_tokens: int = 0
    # Tokens whose KV was imported from the fleet tier at admission (for usage).
    num_transferred_tokens: int = 0
