"""Tool calls read from an answer as it streams, for the gateway's streamed chat answers.

Text that cannot begin a call passes on at once as content; text that may (a format's
opening marker, or a prefix of it at the end of what arrived) is held until it is known:
a call, handed out whole once its closing marker arrives (a Hermes block) or once the
answer ends (a Llama 3.1 answer is one JSON call), or content after all. Blank text
between calls is dropped, as the whole answer's parse strips it, so the streamed content
joins to what the whole answer says.
"""

from __future__ import annotations

from producer.wire.tools.formats import Hermes, Llama3Json, ParsedAnswer, ToolFormat


class ToolCallStream:
    """Feed it an answer's text deltas; it says what to send: content and whole calls."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._held = ""  # text that may be (part of) a call
        self._blank = ""  # blank content kept until text follows it
        # "open": calls may follow; "call": a Llama answer that opened as a call, held to
        # its end; "plain": no more calls can follow, all is content.
        self._mode = "open"

    def feed(self, text: str) -> ParsedAnswer:
        """What ``text`` (the answer's next delta) lets the stream send now."""
        if self._mode == "plain":
            return self._content(text, [])
        buffer, self._held = self._held + text, ""
        if isinstance(self.fmt, Hermes):
            return self._hermes(buffer)
        if self._mode == "open":
            # A Llama answer is a call only as a whole: decided by how it opens.
            head = buffer.lstrip()
            if not head or self.fmt.call_start(buffer) is not None:
                whole = head.startswith("{") or head.startswith(Llama3Json.PYTHON_TAG)
                self._mode = "call" if whole else "open"
                self._held = buffer
                return ParsedAnswer(None)
            self._mode = "plain"
            return self._content(buffer, [])
        self._held = buffer
        return ParsedAnswer(None)

    def finish(self) -> ParsedAnswer:
        """The answer has ended: what was held, read as calls or as content."""
        held, self._held = self._held, ""
        if not held:
            return ParsedAnswer(None)
        parsed = self.fmt.parse(held)
        return self._content(parsed.content or "", parsed.calls, final=True)

    def _hermes(self, buffer: str) -> ParsedAnswer:
        calls, sent = [], []
        while buffer:
            start = self.fmt.call_start(buffer)
            if start is None:
                sent.append(buffer)
                buffer = ""
                break
            sent.append(buffer[:start])
            buffer = buffer[start:]
            end = buffer.find(Hermes.CLOSE)
            if not buffer.startswith(Hermes.OPEN) or end < 0:
                break  # a marker's prefix, or a block not closed yet: held
            block = buffer[:end + len(Hermes.CLOSE)]
            parsed = self.fmt.parse(block)
            if not parsed.calls:  # a block that is no call: the rest is content, as written
                self._plain = True
                sent.append(buffer)
                buffer = ""
                break
            calls.extend(parsed.calls)
            buffer = buffer[len(block):]
        self._held = buffer
        return self._content("".join(sent), calls)

    def _content(self, text: str, calls: list[dict[str, str]],
                 final: bool = False) -> ParsedAnswer:
        """``text`` as content to send, blank text kept back until more text follows (and
        dropped at the end, or around calls)."""
        if calls:
            self._blank = ""
        if not text.strip():
            if not final and not calls:
                self._blank += text
            return ParsedAnswer(None, calls)
        text, self._blank = self._blank + text, ""
        return ParsedAnswer(text, calls)
