"""Incremental detokenizing (worker/tokenizer.py) against decoding the whole output at once.

A request's streamed text deltas, plus what is released when it ends, must be exactly the
text of all its tokens decoded together, however the tokens arrive (one at a time or a few
per step) and wherever a multi-byte character is split over tokens; and no delta may end
in a half character (U+FFFD) that a later token completes.
"""

from __future__ import annotations

import random

import pytest

import worker.tokenizer as tokenizer_module
from worker.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "plain ascii words, and punctuation!",
    "naïve café — déjà vu, Ærøskøbing",
    "中文字符和日本語のテキスト",
    "emoji 🚀🔥 in 👩‍👩‍👧 a family",
    "mixed: ünïcödé 漢字 🎉 end",
    "  leading and   repeated   spaces\nand\nnewlines\t tabs",
]


@pytest.fixture(scope="module", params=["decode-stream", "window"])
def tokenizer(request, tiny_llama) -> Tokenizer:
    """Each test runs with tokenizers' DecodeStream (0.21 and later) and with the window
    decoded in Python (the path for an older tokenizers)."""
    if request.param == "window":
        saved = tokenizer_module.DecodeStream
        tokenizer_module.DecodeStream = None
        request.addfinalizer(lambda: setattr(tokenizer_module, "DecodeStream", saved))
    elif tokenizer_module.DecodeStream is None:
        pytest.skip("tokenizers < 0.21 has no DecodeStream")
    tok = Tokenizer.from_dir(tiny_llama)
    assert tok is not None
    return tok


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
