"""OpenAI's response shapes, built from conveyor's completions and stream events.

``finish_reason`` is OpenAI's ``stop`` or ``length`` for requests that ended normally;
conveyor's own ``cancelled`` (a cancel, or the client went away) and ``expired`` (past the
request's deadline) pass through as they are (docs/gateway.md). A request that failed
(``error``) is answered with an error instead of a choice.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from producer.wire.completion import Completion, TokenLogprob, Usage
from producer.wire.openai_api import ApiRequest, choice_body
from producer.wire.tools.formats import ParsedAnswer, call_deltas, call_seed


class TokenSpeller:
    """Each generated token's text as it reads in the answer, for logprobs.

    A token decoded alone can lose what it means in place (SentencePiece's leading space)
    or be part of one character (byte-level BPE): the text a token adds is found by
    decoding it after the tokens before it. A token whose own bytes are not whole UTF-8
    (a piece of a character) is written as OpenAI writes it, ``bytes:\\xe6\\xbc``, and its
    ``bytes`` are its own: the tokens' bytes join to the answer's UTF-8. Offsets count
    characters before each token. Own bytes are known for byte-level BPE (each character
    of the token's vocabulary string is one byte) and byte-fallback tokens (``<0xE6>``);
    for other tokenizers a token's bytes are its text's.
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.length = 0  # characters spelled so far
        self._prefix = 0  # decoding restarts here (a few tokens back)
        self._read = 0  # tokens whose text was given out
        self._byte_level = (tokenizer is not None
                            and type(tokenizer.decoder).__name__ == "ByteLevel")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def spell(self, token_id: int) -> tuple[str, int, list[int]]:
        """(the token's text here, or ``bytes:...`` where its own bytes are not whole UTF-8;
        characters before it; its bytes)."""
        offset = self.length
        if self.tokenizer is None:
            text = f"<{token_id}>"
            return text, offset, list(text.encode())
        self.ids.append(token_id)
        own = self._own_bytes(token_id)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            piece = ""  # inside a character: the token that completes it carries it
        else:
            piece = after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
            self.length += len(piece)
        if own is None:  # (bytes unknown: the text's)
            return piece, offset, list(piece.encode())
        try:
            own.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in own), offset, list(own)
        return piece, offset, list(own)

    def alone(self, token_id: int) -> str:
        """An alternative's text, decoded by itself."""
        return f"<{token_id}>" if self.tokenizer is None else self._decode([token_id])

    def _own_bytes(self, token_id: int) -> bytes | None:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])  # a byte-fallback token
            except ValueError:
                return None
        if self._byte_level:
            try:
                return bytes(BYTE_OF_CHAR[c] for c in piece)
            except KeyError:  # a special or added token: not bytes of the table
                return None
        return None


def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's table (GPT-2's): each byte is one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


BYTE_OF_CHAR = _byte_of_char()


def response_id(request: ApiRequest, request_id: str) -> str:
    return ("chatcmpl-" if request.chat else "cmpl-") + request_id


def usage_body(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def echo_text(request: ApiRequest, tokenizer: Any | None) -> str:
    """The prompt as an echoing answer starts with it: as given, or its ids decoded."""
    if isinstance(request.prompt, str):
        return request.prompt
    if tokenizer is None or not request.prompt:
        return ""
    return tokenizer.decode(request.prompt, skip_special_tokens=True)


def completion_body(request: ApiRequest, choices: list[Completion], created: int,
                    tokenizer: Any | None, echoed: str = "") -> dict[str, Any]:
    """The whole answer of a request that was not streamed: one choice a Completion (its
    tokens spelled with ``tokenizer`` for logprobs); ``echoed``: the prompt's text, first
    in an echoing answer (with its tokens' logprobs first, where asked)."""
    first = choices[0]
    bodies = []
    for index, done in enumerate(choices):
        speller = TokenSpeller(tokenizer)
        prompt = (prompt_logprobs_body(request, done.prompt_token_ids, done.prompt_logprobs,
                                       speller) if request.echo else None)
        logprobs = joined_logprobs(prompt, logprobs_body(request, done.logprobs, speller))
        bodies.append({**choice_body(request.chat, echoed + done.text, str(done.finish_reason),
                                     logprobs, request.reads_calls,
                                     call_seed(first.request_id, index)),
                       "index": index})
    return {"id": response_id(request, first.request_id),
            "object": "chat.completion" if request.chat else "text_completion",
            "created": created, "model": request.model, "choices": bodies,
            "usage": usage_body(choices_usage([c.usage for c in choices]))}


def choices_usage(usages: list[Usage]) -> Usage:
    """A request's usage over its choices' (choice 0 first): its prompt once, every
    choice's tokens."""
    first = usages[0]
    return Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages),
                 first.cached_tokens, first.kv_transferred_tokens)


# Stands for a chunk's text while its event's shape is made (no text holds it: private use).
_TEXT_MARK = "\ue000text\ue000"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event holding ``payload`` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class ChunkWriter:
    """The chunks of one streamed answer, in order."""

    def __init__(self, request: ApiRequest, request_id: str, created: int,
                 speller: TokenSpeller, index: int = 0) -> None:
        self.request = request
        self.index = index  # the choice's
        self.id = response_id(request, request_id)
        self.created = created
        self.speller = speller
        self.calls = 0  # tool calls begun (read_calls)
        self._call_seed = call_seed(request_id, index)
        # A text chunk's event around its text, made once: a stream's chunks differ in
        # nothing else, and the whole chunk through json.dumps cost ~6 µs an event.
        shape = sse(self.text(_TEXT_MARK, None))
        self._before, _, self._after = shape.partition(json.dumps(_TEXT_MARK, ensure_ascii=False))

    def text_event(self, text: str) -> str:
        """The server-sent event of a text chunk without logprobs: sse(self.text(text,
        None)), the same characters."""
        return self._before + json.dumps(text, ensure_ascii=False) + self._after

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.request.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.request.model, "choices": choices, **extra}

    def first(self, usage: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Chat opens with the assistant's role and no content; completions with nothing.
        ``usage`` (continuous usage): the chunk carries it."""
        if not self.request.chat:
            return None
        return self._chunk([{"index": self.index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}], **_usage(usage))

    def echo(self, text: str, prompt_ids: list[int] | None,
             prompt_logprobs: list[TokenLogprob | None] | None) -> dict[str, Any]:
        """An echoing completion's first chunk: the prompt, and its tokens' logprobs where
        asked."""
        lp = prompt_logprobs_body(self.request, prompt_ids, prompt_logprobs, self.speller)
        return self._chunk([{"index": self.index, "text": text, "logprobs": lp,
                             "finish_reason": None}])

    def text(self, text: str, logprobs: list[TokenLogprob] | None,
             usage: dict[str, Any] | None = None) -> dict[str, Any]:
        lp = logprobs_body(self.request, logprobs, self.speller)
        if self.request.chat:
            choice = {"index": self.index, "delta": {"content": text}, "logprobs": lp,
                      "finish_reason": None}
        else:
            choice = {"index": self.index, "text": text, "logprobs": lp, "finish_reason": None}
        return self._chunk([choice], **_usage(usage))

    def last(self, finish_reason: str, text: str = "", usage: dict[str, Any] | None = None
             ) -> dict[str, Any]:
        if self.request.chat:
            delta = {"content": text} if text else {}
            choice = {"index": self.index, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": self.index, "text": text, "logprobs": None,
                      "finish_reason": finish_reason}
        return self._chunk([choice], **_usage(usage))

    def read_calls(self, parsed: ParsedAnswer, logprobs: list[TokenLogprob] | None = None,
                   usage: dict[str, Any] | None = None) -> list[str]:
        """The events of what a tool-call reader (producer/wire/tools/stream.py) let
        through: content (with the delta's logprobs, where asked), then the calls' deltas
        (a call's name, pieces of its arguments), which a client joins by index; ``usage``
        (continuous usage) on each."""
        events = []
        if parsed.content or logprobs:
            events.append(sse(self.text(parsed.content or "", logprobs, usage)))
        for delta in call_deltas(parsed.calls, self._call_seed):
            events.append(sse(self._chunk([{"index": self.index, "delta": {"tool_calls": delta},
                                            "logprobs": None, "finish_reason": None}],
                                          **_usage(usage))))
        self.calls += sum("name" in d for d in parsed.calls)
        return events

    def usage(self, usage: Usage) -> dict[str, Any]:
        """stream_options.include_usage: a last chunk with the usage and no choices."""
        return self._chunk([], usage=usage_body(usage))


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The usage so far of a streamed answer (continuous usage): its tokens until now."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    return {} if usage is None else {"usage": usage}


def logprobs_body(request: ApiRequest, logprobs: list[TokenLogprob] | None,
                  speller: TokenSpeller) -> dict[str, Any] | None:
    """Logprobs in the answer's shape (chat's ``content`` list, or completions' four lists),
    each token spelled where it stands in the answer."""
    if not request.logprobs or logprobs is None:
        return None
    spelled = [speller.spell(lp.token_id) for lp in logprobs]
    if request.chat:
        return {"content": [
            {"token": text, "logprob": lp.logprob, "bytes": own,
             "top_logprobs": [{"token": speller.alone(t), "logprob": a,
                               "bytes": list(speller.alone(t).encode())} for t, a in lp.top]}
            for (text, _, own), lp in zip(spelled, logprobs, strict=True)]}
    return _four_lists(spelled, logprobs, speller)


def prompt_logprobs_body(request: ApiRequest, prompt_ids: list[int] | None,
                         logprobs: list[TokenLogprob | None] | None,
                         speller: TokenSpeller) -> dict[str, Any] | None:
    """An echoing completion's prompt tokens in logprobs' four lists: the first token has
    no logprob (null), as OpenAI answers; spelled before the answer's own tokens."""
    if not request.logprobs or prompt_ids is None or logprobs is None:
        return None
    return _four_lists([speller.spell(t) for t in prompt_ids], logprobs, speller)


def _four_lists(spelled: list[tuple[str, int, list[int]]],
                logprobs: Sequence[TokenLogprob | None], speller: TokenSpeller
                ) -> dict[str, Any]:
    """Completions' logprobs: tokens, their logprobs, the alternatives, the offsets (null
    logprob and alternatives for a token without them: a prompt's first)."""
    return {"tokens": [text for text, _, _ in spelled],
            "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
            "top_logprobs": [None if lp is None else {speller.alone(t): a for t, a in lp.top}
                             for lp in logprobs],
            "text_offset": [offset for _, offset, _ in spelled]}


def joined_logprobs(first: dict[str, Any] | None, then: dict[str, Any] | None
                    ) -> dict[str, Any] | None:
    """Completions' four logprob lists of the prompt, then of the answer."""
    if first is None or then is None:
        return then if first is None else first
    return {name: first[name] + then[name] for name in then}
