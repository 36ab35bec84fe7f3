"""Incremental detokenizing (worker/engine/tokenizer.py) against decoding the whole output at once.

A request's streamed text deltas, plus what is released when it ends, must be exactly the
text of all its tokens decoded together, however the tokens arrive (one at a time or a few
per step) and wherever a multi-byte character is split over tokens; and no delta may end
in a half character (U+FFFD) that a later token completes.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as HFTokenizer

import worker.engine.tokenizer as tokenizer_module
from producer.wire.params import SamplingParams
from producer.wire.protocol import OutputChunk
from worker.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from worker.fleet.messages import Forget
from worker.fleet.publishing.chunk_holder import joined
from worker.fleet.publishing.publisher import Publication
from worker.fleet.publishing.text_stage import TextStage, Track

TEXTS = [
    "plain ascii words, and punctuation!",
    "naïve café — déjà vu, Ærøskøbing",
    "中文字符和日本語のテキスト",
    "emoji 🚀🔥 in 👩‍👩‍👧 a family",
    "mixed: ünïcödé 漢字 🎉 end",
    "  leading and   repeated   spaces\nand\nnewlines\t tabs",
]


@pytest.fixture(scope="module", params=["decode-stream", "window"])
def path(request) -> str:
    """Each test runs with tokenizers' DecodeStream (0.21 and later) and with the window
    decoded in Python (the path for an older tokenizers)."""
    if request.param == "window":
        saved = tokenizer_module.DecodeStream
        tokenizer_module.DecodeStream = None
        request.addfinalizer(lambda: setattr(tokenizer_module, "DecodeStream", saved))
    elif tokenizer_module.DecodeStream is None:
        pytest.skip("tokenizers < 0.21 has no DecodeStream")
    return request.param


@pytest.fixture(scope="module")
def tokenizer(path, tiny_llama) -> Tokenizer:
    tok = Tokenizer.from_dir(tiny_llama)
    assert tok is not None
    return tok


def byte_fallback_tokenizer() -> tuple[Tokenizer, dict[str, int]]:
    """A SentencePiece-style tokenizer (as Llama 2's): byte tokens <0x..> for what the
    vocabulary lacks, decoded by ByteFallback + Fuse + Strip, where a run of bytes that is
    not UTF-8 becomes U+FFFD and rewrites text already decoded."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["\u2581", "a", "b", "c", "\u2581a", "\u2581b", "ab", "\u2581ab", "\u00e9",
                  "\u2581\u00e9", "hello", "\u2581hello"]:
        vocab.setdefault(piece, len(vocab))
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True,
                                fuse_unk=True))
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return Tokenizer(hf), vocab


def stream(tokenizer: Tokenizer, ids: list[int], rng: random.Random) -> tuple[list[str], str]:
    """Deltas of ``ids`` fed in chunks of 1-3 tokens, and what the end releases."""
    detok = IncrementalDetokenizer(tokenizer)
    deltas, at = [], 0
    while at < len(ids):
        step = rng.randint(1, 3)
        deltas.append(detok.add(ids[at:at + step]))
        at += step
    return deltas, detok.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_of_encoded_text_is_its_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    for seed in range(5):
        deltas, rest = stream(tokenizer, ids, random.Random(seed))
        assert "".join(deltas) + rest == tokenizer.decode(ids) == text
        assert not any(d.endswith("\ufffd") for d in deltas)


def test_streamed_text_of_random_tokens_is_their_whole_decode(tokenizer):
    """Random ids split characters anywhere (byte-level tokens): the stream still adds up."""
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        deltas, rest = stream(tokenizer, ids, rng)
        assert "".join(deltas) + rest == tokenizer.decode(ids)


def test_bytes_that_are_not_utf8_never_stop_the_stream(path):
    """DecodeStream raises when such bytes rewrite text it already emitted (here a newline
    byte followed by a lone lead byte); the stream goes on with the window instead."""
    tok, vocab = byte_fallback_tokenizer()
    ids = [vocab["\u2581hello"], vocab["<0x0A>"], vocab["<0xE1>"], vocab["\u2581a"], vocab["b"]]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([t]) for t in ids]
    assert deltas[:2] == ["hello", "\n"]
    assert "".join(deltas).endswith("ab") and detok.text == "".join(deltas)
    rng = random.Random(1)
    for _ in range(500):  # random ids: byte runs cut anywhere, never an exception
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        deltas, _ = stream(tok, ids, rng)
        assert not any(d.endswith("\ufffd") for d in deltas)


def test_byte_fallback_text_streams_as_its_whole_decode(path):
    tok, _ = byte_fallback_tokenizer()
    for text in ["hello \u00e9 ab", "\u65e5\u672c hello", "emoji \U0001f600 ab", "a\nb  c"]:
        ids = tok.encode(text, add_special_tokens=False)
        for seed in range(5):
            deltas, rest = stream(tok, ids, random.Random(seed))
            assert "".join(deltas) + rest == tok.decode(ids) == text


def test_a_resumed_request_never_repeats_published_text(tokenizer):
    """The earlier worker published the text of its tokens up to a character the last of
    them only began: the next chunk carries the rest of the text, nothing twice."""
    text = "ab \u65e5\u672c\u8a9e cd"
    ids = tokenizer.encode(text, add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    published = tokenizer.decode(ids[:cut]).rstrip("\ufffd")
    stage = TextStage(tokenizer, on_stop=lambda rid: None)
    stage.track(Track("r", SamplingParams(), 3, ("s", "1-0"), ids[:cut], published))
    pub = Publication("r", OutputChunk(cut, ids[cut:]))
    assert stage.apply(pub)
    stage.fill(pub)  # no stop strings: its text is made as it leaves the chunk holder
    assert published + pub.chunk.text == text


def test_a_request_without_stop_strings_gets_its_text_as_its_chunk_leaves(tokenizer):
    """No stop strings: ``apply`` leaves each step's text empty, and ``fill`` decodes a
    joined chunk's tokens at once, to the text step-by-step decoding gives; a request
    forgotten in the tick (handed on) still gets the text of what leaves in that tick."""
    text = "ab \u65e5\u672c\u8a9e cd efg"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stage = TextStage(tokenizer, on_stop=lambda rid: None)
    stage.track(Track("r", SamplingParams(), 3, ("s", "1-0")))
    steps = [Publication("r", OutputChunk(i, [t])) for i, t in enumerate(ids)]
    assert all(stage.apply(p) for p in steps) and all(p.chunk.text == "" for p in steps)
    first, rest = Publication("r", steps[0].chunk), Publication("r", joined(
        [p.chunk for p in steps[1:]]))
    for pub in (first, rest):
        stage.fill(pub)
    assert first.chunk.text + rest.chunk.text == tokenizer.decode(ids) == text

    stage.track(Track("h", SamplingParams(), 3, ("s", "2-0")))
    handed = Publication("h", OutputChunk(0, ids))
    assert stage.apply(handed)
    stage.forget(Forget("h"))  # in the same tick as its chunk
    stage.fill(handed)
    # (A detokenizer may hold back the text of the last tokens for now.)
    assert handed.chunk.text and text.startswith(handed.chunk.text)
    stage.end_tick()
    assert stage.num_followed == 1  # "r" (no final yet); "h" is gone
