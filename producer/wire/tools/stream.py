"""Tool calls read from an answer as it arrives: for the gateway's streamed chat answers,
and (fed the whole answer at once) for a whole one, so the two never disagree.

Text that cannot begin a call passes on at once as content; text that may (a format's
opening marker, or a prefix of it at the end of what arrived) is held until it is known.

A Hermes block that opens with its name (``{"name": "...", "arguments": {``, as templates
and forced grammars write it: scan.read_header) is a call from there: a first delta with
its name, then its arguments' text as it comes, to the end of their object, read as JSON
(scan.ObjectScan: a brace or ``</tool_call>`` inside a string is text). What follows the
object up to ``</tool_call>`` is not part of the call. An answer cut by ``max_tokens``
inside the arguments keeps the call, its arguments cut (finish reason ``length``), as
OpenAI's; a free model's broken JSON ends at the block's closing marker, its arguments as
written. A block that does not open with a name is held to its closing marker and read
whole: a call where its JSON is one (``{"name", "arguments"}`` in any order), else it and
all after it are content, as written. A Llama 3.1 answer is one JSON call: held to its end.

Content: blank text at its end is held back and dropped where the answer made calls, and
at its start where a call came first. A block cut off in its head (before its name is
whole) is neither a call nor content; a prefix of the marker cut off after calls is dropped.

A delta is ``{"index", "name"?, "arguments"}``: ``index`` the call's place in the answer,
``name`` on its first delta only, ``arguments`` a piece of its arguments' text.
"""

from __future__ import annotations

from typing import Any

from producer.wire.tools.formats import Hermes, Llama3Json, ParsedAnswer, ToolFormat, call_of
from producer.wire.tools.scan import (
    CALL,
    CLOSED,
    MARKER,
    MORE,
    WAIT,
    ObjectScan,
    partial_marker,
    read_header,
)

# Text after a block's marker that may be its call's head: read no further for it (a call
# written otherwise is read whole at the block's end).
MAX_HEADER_CHARS = 256
OPEN, CLOSE = Hermes.OPEN, Hermes.CLOSE


class ToolCallStream:
    """Feed it an answer's text deltas; it says what to send: content and call deltas."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        # "open": calls may follow; "call": a Llama answer that opened as a call, held to
        # its end; "plain": no more calls can follow, all is content.
        self._mode = "open"
        self._held: list[str] = []  # a Llama answer so far; a Hermes block read whole
        self._carry = ""  # Hermes text not read yet: a marker's prefix, a call's head
        # Where a Hermes answer is: outside blocks (None), in a block's "head", a call's
        # "arguments", "after" them, or a block to be read "whole".
        self._block: str | None = None
        self._scan: ObjectScan | None = None
        self._blank: list[str] = []  # blank content held until text follows it
        self._calls = 0  # calls begun (their deltas' indexes)
        self._spoke = False  # content was handed out
        self._said: list[str] = []
        self._deltas: list[dict[str, Any]] = []

    def feed(self, text: str) -> ParsedAnswer:
        """What ``text`` (the answer's next delta) lets the stream send now."""
        if self._mode == "plain":
            return ParsedAnswer(self._say(text) or None)
        if isinstance(self.fmt, Hermes):
            self._read(self._carry + text)
            return self._out()
        self._held.append(text)
        if self._mode == "open" and text.strip():  # (blank text decides nothing)
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
        if isinstance(self.fmt, Hermes):
            self._end_hermes()
            return self._out()
        held, self._held = "".join(self._held), []
        parsed = self.fmt.parse(held) if held else ParsedAnswer(None)
        for call in parsed.calls:
            self._begin(call["name"], call["arguments"])
        self._said.append(self._say(parsed.content or "", final=True))
        return self._out()

    def _read(self, text: str) -> None:
        """Read ``text`` (with what was carried) as far as it can be read now."""
        self._carry, at = "", 0
        while at < len(text) and self._mode != "plain":
            at = getattr(self, f"_{self._block or 'outside'}")(text, at)
            if at is None:
                return
        if at < len(text):  # (a block that was no call: the rest is content)
            self._said.append(self._say(text[at:]))

    # Each part reads on from ``at``: where it stopped, or None where the rest must wait
    # for more text (what of it is needed kept in ``_carry``).

    def _outside(self, text: str, at: int) -> int | None:
        begin = text.find(OPEN, at)
        if begin < 0:
            end = partial_marker(text, OPEN, at)
            self._said.append(self._say(text[at:end]))
            self._carry = text[end:]
            return None
        self._said.append(self._say(text[at:begin]))
        self._block = "head"
        return begin + len(OPEN)

    def _head(self, text: str, at: int) -> int | None:
        verdict, start, name = read_header(text[at:at + MAX_HEADER_CHARS])
        if verdict == MORE and len(text) - at < MAX_HEADER_CHARS:
            self._carry = text[at:]
            return None
        if verdict == CALL:
            self._begin(name, "")
            self._block, self._scan = "arguments", ObjectScan(CLOSE)
            return at + start
        self._block, self._held = "whole", []
        return at

    def _arguments(self, text: str, at: int) -> int | None:
        end, why = self._scan.scan(text, at)
        self._piece(text[at:end])
        if why == CLOSED:
            self._block = "after"
            return end
        if why == MARKER:  # (broken JSON: its block ended first)
            self._block = None
            return end + len(CLOSE)
        self._carry = text[end:] if why == WAIT else ""
        return None

    def _after(self, text: str, at: int) -> int | None:
        end = text.find(CLOSE, at)
        if end >= 0:
            self._block = None
            return end + len(CLOSE)
        self._carry = text[partial_marker(text, CLOSE, at):]
        return None

    def _whole(self, text: str, at: int) -> int | None:
        end = text.find(CLOSE, at)
        if end < 0:
            cut = partial_marker(text, CLOSE, at)
            self._held.append(text[at:cut])
            self._carry = text[cut:]
            return None
        self._held.append(text[at:end])
        self._read_whole()
        return end + len(CLOSE)

    def _read_whole(self, closed: bool = True) -> None:
        """The held block, read whole: its call, or (not one) it as content, and then
        all that follows it."""
        body, self._held, self._block = "".join(self._held), [], None
        call = call_of(body, self.fmt.arguments_key)
        if call is not None:
            self._begin(call["name"], call["arguments"])
            return
        self._mode = "plain"
        self._said.append(self._say(OPEN + body + (CLOSE if closed else "")))

    def _end_hermes(self) -> None:
        carried, self._carry = self._carry, ""
        if self._block == "whole":
            self._held.append(carried)
            self._read_whole(closed=False)
        elif self._block is None and carried and not self._calls:
            # A marker's prefix cut off: text, where no call came before it.
            self._said.append(self._say(carried))
        # (a block cut in its head, before its name was whole: no call and no content; in a
        # call's arguments or after them: the call stands, a marker's prefix no part of it)
        self._said.append(self._say("", final=True))

    def _begin(self, name: str, arguments: str) -> None:
        self._deltas.append({"index": self._calls, "name": name, "arguments": arguments})
        self._calls += 1

    def _piece(self, arguments: str) -> None:
        if arguments:
            self._deltas.append({"index": self._calls - 1, "arguments": arguments})

    def _out(self) -> ParsedAnswer:
        said, self._said = "".join(self._said), []
        deltas, self._deltas = self._deltas, []
        return ParsedAnswer(said or None, deltas)

    def _say(self, text: str, final: bool = False) -> str:
        """``text`` as content to send: blank text at its end held until more text follows
        (at the answer's end sent only where it made no calls: ``final``), and blank text
        at the content's start dropped once a call came first (the whole parse strips
        both)."""
        body = text.rstrip()
        if body:  # (held blank text joined once, when text follows it)
            body, self._blank = "".join(self._blank) + body, [text[len(body):]]
        elif text:
            self._blank.append(text)
        if final and not self._calls:
            body, self._blank = body + "".join(self._blank), []
        if not self._spoke and self._calls:
            body = body.lstrip()
        self._spoke = self._spoke or bool(body)
        return body


def read_whole(fmt: ToolFormat, text: str) -> ParsedAnswer:
    """A whole answer read as a stream of it reads it: its content and calls."""
    stream = ToolCallStream(fmt)
    first, last = stream.feed(text), stream.finish()
    calls: list[dict[str, str]] = []
    for delta in [*first.calls, *last.calls]:
        if "name" in delta:
            calls.append({"name": delta["name"], "arguments": ""})
        calls[delta["index"]]["arguments"] += delta["arguments"]
    content = (first.content or "") + (last.content or "")
    return ParsedAnswer(content or None, calls)
