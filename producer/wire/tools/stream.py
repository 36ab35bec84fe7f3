"""Tool calls read from an answer as it streams, for the gateway's streamed chat answers.

Text that cannot begin a call passes on at once as content; text that may (a format's
opening marker, or a prefix of it at the end of what arrived) is held until it is known.
A Hermes block that opens with its name (formats.CALL_HEADER, as templates and forced
grammars write it) is sent as it comes: a first delta with the call's name, then its
arguments' text, less what may be the call's end (a closing brace, blank text, the start
of ``</tool_call>``), held until more text shows it is not; a block written otherwise is
sent whole at its closing marker. A Llama 3.1 answer is one JSON call: held to its end.
What is sent joins to what the whole answer's parse says (formats.ToolFormat.parse): the
same calls and arguments, and the same content (blank text at its end held back and
dropped where the answer made calls, as that parse strips it). One answer cannot agree: a
block that opened with a name and then does not parse (a free model's broken JSON) has
sent its first deltas; the rest of it is content, as in the whole parse.

A delta is ``{"index", "name"?, "arguments"}``: ``index`` the call's place in the answer,
``name`` on its first delta only, ``arguments`` a piece of its arguments' text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from producer.wire.tools.formats import CALL_HEADER, Hermes, Llama3Json, ParsedAnswer, ToolFormat

# Text a block may hold before its header is given up on (then sent whole at its end).
MAX_HEADER_CHARS = 256
# What may end a call's arguments' text: blank text, the call's closing brace, blank text
# and a part of the closing marker (never whole: that ends the block before this is read).
_CALL_END = re.compile(r"\s*(?:\}\s*)?(?:" + "|".join(
    re.escape(Hermes.CLOSE[:k]) for k in range(len(Hermes.CLOSE) - 1, 0, -1)) + ")?$")


@dataclass
class _OpenCall:
    """A Hermes call whose arguments are being sent."""

    index: int
    unsent: str  # its text since the last piece sent (what may be its end, held)
    sent: int = 0  # characters of its arguments sent


class ToolCallStream:
    """Feed it an answer's text deltas; it says what to send: content and call deltas."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        # Text that may be (part of) a call, in parts (a long call arrives in many deltas:
        # joined once, when it can be read).
        self._held: list[str] = []
        # The held text's last characters: a closing marker may begin there.
        self._tail = ""
        self._blank = ""  # blank content held until text follows it
        # "open": calls may follow; "call": a Llama answer that opened as a call, held to
        # its end; "plain": no more calls can follow, all is content.
        self._mode = "open"
        self._calls = 0  # calls begun (their deltas' indexes)
        self._open: _OpenCall | None = None
        self._headerless = False  # the held block did not open with its name
        self._spoke = False  # content was handed out

    def feed(self, text: str) -> ParsedAnswer:
        """What ``text`` (the answer's next delta) lets the stream send now."""
        if self._mode == "plain":
            return ParsedAnswer(self._say(text) or None)
        if isinstance(self.fmt, Hermes):
            return self._hermes(text)
        self._held.append(text)
        if self._mode == "open":
            # A Llama answer is a call only as a whole: decided by how it opens.
            buffer = "".join(self._held)
            head = buffer.lstrip()
            if head.startswith("{") or head.startswith(Llama3Json.PYTHON_TAG):
                self._mode = "call"
            elif head and self.fmt.call_start(buffer) is None:
                self._mode, self._held = "plain", []
                return ParsedAnswer(self._say(buffer) or None)
        return ParsedAnswer(None)

    def finish(self) -> ParsedAnswer:
        """The answer has ended: what was held, read as calls or as content."""
        held, self._held = "".join(self._held), []
        parsed = self.fmt.parse(held) if held else ParsedAnswer(None)
        deltas = [d for call in parsed.calls for d in self._close(call)]
        return ParsedAnswer(self._say(parsed.content or "", final=True) or None, deltas)

    def _hermes(self, text: str) -> ParsedAnswer:
        if self._held and self._held[0].startswith(Hermes.OPEN):
            # Inside a block: only the new text, after the end of what came before it, can
            # hold the closing marker.
            tail = self._tail + text
            self._held.append(text)
            if Hermes.CLOSE not in tail:
                self._tail = tail[-(len(Hermes.CLOSE) - 1):]
                return ParsedAnswer(None, self._arguments(text))
        else:
            self._held.append(text)
        buffer = "".join(self._held)
        self._held, self._tail = [], ""
        deltas, sent = [], []
        while buffer:
            start = self.fmt.call_start(buffer)
            if start is None:
                sent.append(self._say(buffer))
                buffer = ""
                break
            sent.append(self._say(buffer[:start]))
            buffer = buffer[start:]
            end = buffer.find(Hermes.CLOSE)
            if not buffer.startswith(Hermes.OPEN) or end < 0:
                break  # a marker's prefix, or a block not closed yet: held
            block = buffer[:end + len(Hermes.CLOSE)]
            parsed = self.fmt.parse(block)
            if not parsed.calls:  # a block that is no call: the rest is content, as written
                self._open, self._mode = None, "plain"
                sent.append(self._say(buffer))
                buffer = ""
                break
            deltas.extend(self._close(parsed.calls[0]))
            buffer = buffer[len(block):]
        if buffer:
            self._held, self._tail = [buffer], buffer[-(len(Hermes.CLOSE) - 1):]
            if buffer.startswith(Hermes.OPEN):
                deltas.extend(self._arguments(""))
        return ParsedAnswer("".join(sent) or None, deltas)

    def _arguments(self, text: str) -> list[dict[str, object]]:
        """The deltas of the held block's call that ``text`` (its newest text) lets out:
        its name once the block shows it, then its arguments less what may be its end."""
        deltas: list[dict[str, object]] = []
        call = self._open
        if call is None:
            if self._headerless:
                return deltas
            held = "".join(self._held)
            header = CALL_HEADER.match(held, len(Hermes.OPEN))
            if header is None:
                self._headerless = len(held) > MAX_HEADER_CHARS
                return deltas
            call = self._open = _OpenCall(self._calls, held[header.end():])
            self._calls += 1
            deltas.append({"index": call.index, "name": header.group(1), "arguments": ""})
        else:
            call.unsent += text
        cut = _CALL_END.search(call.unsent).start()
        if cut:
            deltas.append({"index": call.index, "arguments": call.unsent[:cut]})
            call.sent += cut
            call.unsent = call.unsent[cut:]
        return deltas

    def _close(self, whole: dict[str, str]) -> list[dict[str, object]]:
        """The deltas left of a call now read whole: the rest of its arguments where they
        were being sent, else the whole call."""
        call, self._open, self._headerless = self._open, None, False
        if call is None:
            self._calls += 1
            return [{"index": self._calls - 1, **whole}]
        rest = whole["arguments"][call.sent:]
        return [{"index": call.index, "arguments": rest}] if rest else []

    def _say(self, text: str, final: bool = False) -> str:
        """``text`` as content to send: blank text at its end held until more text follows
        (at the answer's end sent only where it made no calls: ``final``), and blank text
        at the content's start dropped once a call came first (the whole parse strips
        both)."""
        text = self._blank + text
        body = text.rstrip()
        self._blank = text[len(body):]
        if final and not self._calls:
            body, self._blank = body + self._blank, ""
        if not self._spoke and self._calls:
            body = body.lstrip()
        self._spoke = self._spoke or bool(body)
        return body
