"""Tool calls read from an answer as it streams, for the gateway's streamed chat answers.

Text that cannot begin a call passes on at once as content; text that may (a format's
opening marker, or a prefix of it at the end of what arrived) is held until it is known:
a call, handed out whole once its closing marker arrives (a Hermes block) or once the
answer ends (a Llama 3.1 answer is one JSON call), or content after all. The content joins
to what the whole answer's parse says (formats.ToolFormat.parse): blank text at its end is
held back and dropped where the answer made calls, as that parse strips it.
"""

from __future__ import annotations

from producer.wire.tools.formats import Hermes, Llama3Json, ParsedAnswer, ToolFormat


class ToolCallStream:
    """Feed it an answer's text deltas; it says what to send: content and whole calls."""

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
        self._called = False  # a call was handed out
        self._spoke = False  # content was handed out

    def feed(self, text: str) -> ParsedAnswer:
        """What ``text`` (the answer's next delta) lets the stream send now."""
        if self._mode == "plain":
            return self._content(text, [])
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
                return self._content(buffer, [])
        return ParsedAnswer(None)

    def finish(self) -> ParsedAnswer:
        """The answer has ended: what was held, read as calls or as content."""
        held, self._held = "".join(self._held), []
        parsed = self.fmt.parse(held) if held else ParsedAnswer(None)
        return self._content(parsed.content or "", parsed.calls, final=True)

    def _hermes(self, text: str) -> ParsedAnswer:
        if self._held and self._held[0].startswith(Hermes.OPEN):
            # Inside a block: only the new text, after the end of what came before it, can
            # hold the closing marker.
            tail = self._tail + text
            self._held.append(text)
            if Hermes.CLOSE not in tail:
                self._tail = tail[-(len(Hermes.CLOSE) - 1):]
                return ParsedAnswer(None)
        else:
            self._held.append(text)
        buffer = "".join(self._held)
        self._held, self._tail = [], ""
        calls, sent = [], []
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
                self._mode = "plain"
                sent.append(self._say(buffer))
                buffer = ""
                break
            calls.extend(parsed.calls)
            self._called = True
            buffer = buffer[len(block):]
        if buffer:
            self._held, self._tail = [buffer], buffer[-(len(Hermes.CLOSE) - 1):]
        return ParsedAnswer("".join(sent) or None, calls)

    def _content(self, text: str, calls: list[dict[str, str]],
                 final: bool = False) -> ParsedAnswer:
        """``text``, then ``calls``: what to send of them."""
        body = self._say(text, final and not calls)
        self._called = self._called or bool(calls)
        return ParsedAnswer(body or None, calls)

    def _say(self, text: str, final: bool = False) -> str:
        """``text`` as content to send: blank text at its end held until more text follows
        (at the answer's end sent only where it made no calls: ``final``), and blank text
        at the content's start dropped once a call came first (the whole parse strips
        both)."""
        text = self._blank + text
        body = text.rstrip()
        self._blank = text[len(body):]
        if final and not self._called:
            body, self._blank = body + self._blank, ""
        if not self._spoke and self._called:
            body = body.lstrip()
        self._spoke = self._spoke or bool(body)
        return body
