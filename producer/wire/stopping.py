"""When a request stops generating: the rules the engine, the scheduler and a resuming
worker share."""

from __future__ import annotations

from collections.abc import Collection

from producer.wire.completion import FinishReason


def stop_reason(
    last_token: int,
    num_output_tokens: int,
    num_tokens: int,
    *,
    max_tokens: int,
    max_model_len: int,
    stop_token_ids: Collection[int],
    eos_token_ids: Collection[int],
    ignore_eos: bool,
    min_tokens: int = 0,
) -> FinishReason | None:
    """Why a request whose newest token is ``last_token`` is done, or None to go on.

    ``num_tokens`` counts prompt and output. A stop token or (unless ignored) EOS is
    ``stop`` once ``min_tokens`` tokens are out (before, the sampler keeps them out of the
    draw); reaching ``max_tokens`` or the model's length is ``length``. Stop strings are
    text, decided where the text is made (see worker.engine.output_processor).
    """
    if num_output_tokens >= min_tokens and (
            last_token in stop_token_ids or (not ignore_eos and last_token in eos_token_ids)):
        return FinishReason.STOP
    if num_output_tokens >= max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def token_limit(max_tokens: int | None, num_prompt_tokens: int, *, max_model_len: int,
                kv_pool_tokens: int) -> int:
    """How many tokens a request may generate: its ``max_tokens``; without one, until the
    context is full or the whole KV pool is, whichever holds less (the request then ends
    ``length`` there rather than waiting for blocks that cannot exist). At least one: a
    prompt that fills either is refused where lengths are checked, not here."""
    if max_tokens is not None:
        return max_tokens
    return max(1, min(max_model_len, kv_pool_tokens) - num_prompt_tokens)
