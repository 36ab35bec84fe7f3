"""Copy a shipped, hash-checked tokenizer into a checkpoint with its tokenizer_config.json.

Llama 3's vocabulary (128,256 ids) is not trained here: its tokenizer is the shipped
32,000-token one with one more vocabulary entry a further id, ``<|id_N|>`` for id N, that
no merge makes: every id a random-weight model samples decodes to text (that text encodes
to ordinary pieces, not back to N). Entries, not added tokens: a tokenizer with 96,256
added tokens takes llguidance (the engine's grammars) minutes to load, and is four times
the size.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from worker.modelgen.chat_templates import TEMPLATES
from worker.modelgen.config_json import dump_json
from worker.modelgen.presets import BOS_TOKEN, EOS_TOKEN, LLAMA3_VOCAB, TOKENIZER_SHA256

DATA_DIR = Path(__file__).parent / "data"
# The shipped tokenizer the larger vocabularies extend, and those vocabularies.
EXTENDED_FROM = 32000
EXTENDED_VOCABS = (LLAMA3_VOCAB,)


def tokenizer_vocabs() -> list[int]:
    """Every vocabulary size make_model writes a tokenizer for."""
    return sorted([*TOKENIZER_SHA256, *EXTENDED_VOCABS])


def extended_tokenizer(vocab_size: int) -> bytes:
    """tokenizer.json of ``vocab_size`` ids: the shipped EXTENDED_FROM-token one, and a
    vocabulary entry ``<|id_N|>`` for each id N above it (printable ASCII: the byte-level
    decoder writes it out as it is)."""
    import json

    from tokenizers import Tokenizer

    doc = json.loads(read_shipped_tokenizer(EXTENDED_FROM))
    vocab = doc["model"]["vocab"]
    vocab.update((f"<|id_{i}|>", i) for i in range(EXTENDED_FROM, vocab_size))
    data = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
    size = Tokenizer.from_str(data.decode()).get_vocab_size()
    if size != vocab_size:
        raise RuntimeError(f"the extended tokenizer has {size} ids, not {vocab_size}")
    return data


def shipped_tokenizer_path(vocab_size: int) -> Path:
    """The shipped tokenizer JSON for a vocab size (see train_tokenizer.py)."""
    return DATA_DIR / f"tokenizer-{vocab_size}.json"


def read_shipped_tokenizer(vocab_size: int) -> bytes:
    """The shipped tokenizer's bytes, refusing any file whose SHA-256 is not the recorded one."""
    if vocab_size not in TOKENIZER_SHA256:
        raise ValueError(f"no shipped tokenizer with vocab size {vocab_size}")
    data = shipped_tokenizer_path(vocab_size).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != TOKENIZER_SHA256[vocab_size]:
        raise RuntimeError(
            f"{shipped_tokenizer_path(vocab_size)} has sha256 {digest}, "
            f"expected {TOKENIZER_SHA256[vocab_size]}"
        )
    return data


def tokenizer_config(model_max_length: int, chat_template: str = "plain") -> dict[str, Any]:
    """tokenizer_config.json: load tokenizer.json verbatim as a fast tokenizer.

    tokenizer_class is the generic fast class so transformers never swaps in a
    model-specific tokenizer (v5's LlamaTokenizer would rebuild a Metaspace one).
    add_bos_token mirrors the BOS template already in tokenizer.json. ``chat_template``: a
    key of chat_templates.TEMPLATES.
    """
    if chat_template not in TEMPLATES:
        raise ValueError(f"unknown chat template {chat_template!r}; choose from "
                         f"{', '.join(TEMPLATES)}")
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": TEMPLATES[chat_template],
    }


def write_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int,
                    chat_template: str = "plain") -> list[Path]:
    """Write tokenizer.json (a byte copy of the shipped file, or one extended to a larger
    vocabulary) and tokenizer_config.json."""
    tok_path = out_dir / "tokenizer.json"
    tok_path.write_bytes(extended_tokenizer(vocab_size) if vocab_size in EXTENDED_VOCABS
                         else read_shipped_tokenizer(vocab_size))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg_path.write_bytes(dump_json(tokenizer_config(model_max_length, chat_template)))
    return [tok_path, cfg_path]
