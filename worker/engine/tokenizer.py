"""A model's tokenizer.json, and incremental detokenization for streaming text."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


class Tokenizer:
    """Encodes prompts and decodes outputs with a checkpoint's ``tokenizer.json``."""

    def __init__(self, tokenizer: _HFTokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        """The folder's tokenizer, or None when it has no ``tokenizer.json``."""
        path = Path(model_dir) / "tokenizer.json"
        return cls(_HFTokenizer.from_file(str(path))) if path.is_file() else None

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        return cls(_HFTokenizer.from_str(text))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Special tokens as the tokenizer's own post-processor adds them (e.g. BOS), exactly
        # as transformers' tokenizer and a producer's `tokenizers` copy encode the text. A
        # rendered chat template writes its own: encode it without them (as
        # apply_chat_template does).
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Byte-level BPE can split one character over several tokens; a delta is held back while
    it ends in an incomplete character (U+FFFD), and decoding restarts a few tokens back so
    merges across the boundary come out right. That is ``tokenizers``' own DecodeStream
    (0.21 and later), which does it in Rust: ~1.6 us a token against 2.0-2.8 us for two
    Python ``decode`` calls of the window, the publisher's largest cost per token. With an
    older ``tokenizers``, or once DecodeStream refuses a request's text (see ``add``), the
    window is decoded here, the same way. ``by_chunk``: the window alone, whatever the
    release: for tokens added many at a time (a chunk of ~10 at a GPU's step rate, the
    publisher's text stage), two decodes of the window cost less than a DecodeStream step
    for each token.
    """

    def __init__(self, tokenizer: Tokenizer, by_chunk: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens  # (False: special tokens' text is kept)
        self._ids: list[int] = []
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if DecodeStream \
            and not by_chunk else None
        self._prefix_offset = 0  # start of the window that is re-decoded
        self._read_offset = 0  # tokens whose text has been emitted
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the newly completed text (maybe empty)."""
        start = len(self._ids)
        self._ids.extend(token_ids)
        if self._stream is None:
            return self._window()
        pieces = []
        # One id a call: older releases of DecodeStream take no list.
        for end, token in enumerate(token_ids, start + 1):
            try:
                piece = self._stream.step(self._tok._tok, token)
            except Exception:  # tokenizers raises a bare Exception here
                # DecodeStream refuses a window whose text no longer starts with what it
                # emitted: a byte-fallback tokenizer turns a run of bytes that is not UTF-8
                # into U+FFFD, rewriting text already out. The window goes on from the last
                # token emitted, as it would have got there itself.
                self._stream = None
                break
            if piece:
                pieces.append(piece)
                self._prefix_offset, self._read_offset = self._read_offset, end
        delta = "".join(pieces)
        self.text += delta
        return delta if self._stream is not None else delta + self._window()

    def _window(self) -> str:
        """Decode the window from ``_prefix_offset``: the text past what was read, unless it
        ends in an incomplete character."""
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back at the end of a request: the window decoded from
        where the last emitted text began (not the request's every token again), past
        that text; nothing where it does not start with it (text already out is never
        rewritten)."""
        emitted = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        delta = full[len(emitted) :] if full.startswith(emitted) else ""
        self.text += delta
        self._read_offset = self._prefix_offset = len(self._ids)
        return delta
