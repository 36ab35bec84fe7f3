"""Detokenization and stop strings on the publisher thread, off the engine loop.

The engine loop hands over token ids only. Here each request's tokens become text deltas;
when a stop string appears, the request's final entry is written at once and the engine is
asked to abort it, and tokens it produced meanwhile are dropped.

A request with stop strings is detokenized at every step (``apply``: a stop must be seen at
once). One without (most) is detokenized only once its tokens leave the chunk holder
(``fill``): one decode for the ~10 tokens of a chunk at a GPU's step rate, not one a token.
The text a reader gets is the same; only where a chunk's text ends may differ.
"""

from __future__ import annotations

from collections.abc import Callable

from producer.wire.completion import FinishReason
from producer.wire.protocol import FinalEntry
from worker.engine.output_processor import RequestOutputState
from worker.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from worker.fleet.messages import Forget, Track


class TextStage:
    """Per-request text state, used only by the publisher thread."""

    def __init__(self, tokenizer: Tokenizer | None, on_stop: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.on_stop = on_stop
        self._states: dict[str, tuple[RequestOutputState, Track]] = {}
        # Requests ended here by a stop string, until the engine's own final arrives.
        self._stopped: set[str] = set()
        # Requests forgotten in this tick whose last chunks may still be filled (end_tick).
        self._leaving: dict[str, tuple[RequestOutputState, Track]] = {}

    def track(self, item: Track) -> None:
        state = RequestOutputState.create(item.request_id, item.params, 0, item.num_prompt_tokens,
                                          self.tokenizer)
        if self.tokenizer is not None and not item.params.stop:
            # Detokenized a chunk at a time (fill): the window suits that best.
            state.detokenizer = IncrementalDetokenizer(
                self.tokenizer, by_chunk=True,
                skip_special_tokens=item.params.skip_special_tokens)
        if item.published_token_ids:
            state.add_tokens(item.published_token_ids, None)
            # Text the earlier worker held back (a partial character, a possible stop string)
            # was never published: emit from where its stream's text ends, even where this
            # detokenizer holds back more of it for now (the published tokens end inside a
            # character): that text is out already, and is never sent twice.
            state.emitted = len(item.published_text)
        self._states[item.request_id] = (state, item)

    def forget(self, item: Forget) -> None:
        entry = self._states.pop(item.request_id, None)
        if entry is not None and not entry[0].params.stop:
            self._leaving[item.request_id] = entry  # its held chunks go out this tick
        self._stopped.discard(item.request_id)

    def end_tick(self) -> None:
        """After a tick's output was filled: forgotten requests are gone."""
        self._leaving.clear()

    def stopped(self, request_id: str) -> bool:
        """Whether a stop string ended the request here (its final is written or owed)."""
        return request_id in self._stopped

    @property
    def num_followed(self) -> int:
        """Requests with text state here (0 when the worker is idle)."""
        return len(self._states) + len(self._stopped) + len(self._leaving)

    def apply(self, pub) -> bool:
        """Fill in the publication's text (and a stop-string final); False means drop it."""
        rid = pub.request_id
        if rid in self._stopped:
            if pub.final is not None:
                self._stopped.discard(rid)  # the engine's abort caught up: forget the request
            return False
        entry = self._states.get(rid)
        if entry is None:
            return True  # never tracked (e.g. cancelled before it started): nothing to add
        state, track = entry
        if state.params.stop:
            self._text(pub, state, track)
        # (else its text is made once it leaves the chunk holder: fill)
        return True

    def _text(self, pub, state: RequestOutputState, track: Track) -> None:
        """Add the publication's tokens to the request's text and put the new text in it
        (in its final where it has no chunk); a stop string found ends the request here."""
        if pub.chunk is not None:
            state.add_tokens(pub.chunk.token_ids, None)
        if state.hit_stop_string:
            self._stop(pub, state, track)
        elif pub.final is not None:
            state.finish_text()
        end = pub.final is not None
        delta = state.take_delta(final=end)
        if pub.chunk is not None:
            pub.chunk.text = delta
        elif end:
            pub.final.text = delta
        if end:
            self._states.pop(pub.request_id, None)

    def _stop(self, pub, state: RequestOutputState, track: Track) -> None:
        if pub.final is None:
            # Finish here; the engine is told to abort and its later output is dropped.
            num = pub.chunk.index + len(pub.chunk.token_ids)
            pub.final = FinalEntry(str(FinishReason.STOP), num,
                                   {"prompt_tokens": track.num_prompt_tokens,
                                    "completion_tokens": len(state.token_ids),
                                    "cached_tokens": pub.cached_tokens},
                                   id_base=pub.chunk.id_base)
            pub.ack = track.ack
            self._stopped.add(pub.request_id)
            self.on_stop(pub.request_id)
        else:
            pub.final.finish_reason = str(FinishReason.STOP)

    def fill(self, pub) -> None:
        """The text of a publication of a request without stop strings, on its way to Redis
        (in order: the chunk holder keeps each request's output in order)."""
        rid = pub.request_id
        entry = self._states.get(rid) or self._leaving.get(rid)
        if entry is not None and not entry[0].params.stop:  # (else: filled at apply)
            self._text(pub, *entry)
