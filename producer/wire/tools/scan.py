"""Reading a Hermes call's JSON as it arrives, a piece at a time: its header (``{"name":
"...", "arguments":`` up to the arguments' opening brace) and where its arguments' object
ends. Both go by what JSON is (strings, escapes, nesting), so a closing marker or a brace
inside a string is text, and any split of the same text reads the same.
"""

from __future__ import annotations

import re

# JSON's blank characters (not str.isspace's: those include more than JSON allows).
_BLANK = re.compile(r"[ \t\n\r]*")
_NAME = re.compile(r"[A-Za-z0-9_.-]*")
MAX_NAME_CHARS = 64
# The header's parts after the blank before each: literals (alternatives), or the name.
_NAME_PART = ("<name>",)
_HEADER = [("{",), ('"name"',), (":",), ('"',), _NAME_PART, ('"',), (",",),
           ('"arguments"', '"parameters"'), (":",)]

CALL, MORE, NONE = "call", "more", "none"


def read_header(text: str, at: int = 0) -> tuple[str, int, str]:
    """``(CALL, where the arguments' "{" is, name)`` where ``text[at:]`` opens a call with
    its name, as templates and forced grammars write it; ``(MORE, 0, "")`` where it may
    still, given more text; ``(NONE, 0, "")`` where it cannot."""
    name = ""
    for part in [*_HEADER, None]:
        at = _BLANK.match(text, at).end()
        if at == len(text):
            return MORE, 0, ""
        if part is None:  # the arguments' value: an object
            return (CALL, at, name) if text[at] == "{" else (NONE, 0, "")
        if part is _NAME_PART:
            end = _NAME.match(text, at).end()
            name = text[at:end]
            if len(name) > MAX_NAME_CHARS:
                return NONE, 0, ""
            if end == len(text):
                return MORE, 0, ""
            if not name:
                return NONE, 0, ""
            at = end
            continue
        for literal in part:
            if text.startswith(literal, at):
                at += len(literal)
                break
        else:
            rest = text[at:]
            return (MORE, 0, "") if any(lit.startswith(rest) for lit in part) else (NONE, 0, "")
    raise AssertionError("unreachable")


# In a string: its end, an escape, or a raw control character (which JSON forbids in a
# string: the quote that opened it was a free model's slip, not a string's start).
_IN_STRING = re.compile(r'["\\\x00-\x1f]')
_OUTSIDE = re.compile(r'["{}\[\]<]')
_BROKEN = re.compile(r"<")
CLOSED, MARKER, WAIT, END = "closed", "marker", "wait", "end"


class ObjectScan:
    """Where a JSON object that begins at the first text scanned ends, fed in pieces. A
    ``marker`` outside its strings ends it too (a free model's broken JSON, then its
    block's end), and anywhere once a string holds a raw control character (a stray quote
    opened it: its JSON is broken, and a string that never ends must not swallow the
    answer); a prefix of the marker at the end of a piece waits for more."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.broken = False  # no longer JSON: only the marker ends it

    def scan(self, text: str, at: int) -> tuple[int, str]:
        """How far ``text[at:]`` is the object's: ``(end, CLOSED)`` just past its closing
        brace; ``(where, MARKER)`` at the marker; ``(where, WAIT)`` at a prefix of the
        marker that ends the text; ``(len(text), END)`` where all of it is."""
        n = len(text)
        while at < n:
            if self.escaped:
                self.escaped, at = False, at + 1
            elif self.in_string:
                found = _IN_STRING.search(text, at)
                if found is None:
                    return n, END
                at, char = found.end(), found.group()
                if char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                else:
                    self.in_string, self.broken = False, True
            else:
                found = (_BROKEN if self.broken else _OUTSIDE).search(text, at)
                if found is None:
                    return n, END
                at, char = found.start(), found.group()
                if char == "<":
                    if text.startswith(self.marker, at):
                        return at, MARKER
                    if n - at < len(self.marker) and self.marker.startswith(text[at:]):
                        return at, WAIT
                    at += 1
                    continue
                at += 1
                if char == '"':
                    self.in_string = True
                elif char in "{[":
                    self.depth += 1
                else:
                    self.depth -= 1
                    if self.depth <= 0:
                        return at, CLOSED
        return n, END


def partial_marker(text: str, marker: str, at: int = 0) -> int:
    """Where in ``text[at:]`` a proper prefix of ``marker`` ends the text (a marker may
    arrive split); ``len(text)`` where none does."""
    for size in range(min(len(marker) - 1, len(text) - at), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return len(text)
