"""make_model: write a small deterministic Hugging Face checkpoint to a local folder."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from worker.modelgen.config_json import build_config, build_generation_config, dump_json
from worker.modelgen.presets import ARCHS, PRESETS
from worker.modelgen.safetensors_io import INDEX_FILE, shards_needed, write_weights
from worker.modelgen.tokenizer_files import tokenizer_vocabs, write_tokenizer
from worker.modelgen.weights import draw, weight_specs

# The precisions make_model writes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Every fixed-name file make_model may write (weights aside, which are globbed).
OWN_FILES = (
    "config.json",
    "generation_config.json",
    INDEX_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
)
# The file `conveyor make-model` leaves in a folder it made (its settings, as JSON): only such
# a folder may it delete and make again (--force).
MARKER_FILE = ".conveyor-model"


def mark_folder(out_dir: str | os.PathLike[str], **settings: Any) -> None:
    """Mark ``out_dir`` as a folder `conveyor make-model` made, with the settings it used."""
    marker = {"made_by": "conveyor make-model", **settings}
    (Path(out_dir) / MARKER_FILE).write_text(json.dumps(marker, sort_keys=True) + "\n")


def is_marked_folder(out_dir: str | os.PathLike[str]) -> bool:
    """Whether `conveyor make-model` made ``out_dir`` (see :func:`mark_folder`)."""
    return (Path(out_dir) / MARKER_FILE).is_file()


def make_model(
    out_dir: str | os.PathLike[str],
    preset: str = "tiny",
    arch: str = "llama",
    seed: int = 0,
    *,
    tie_word_embeddings: bool | None = None,
    num_kv_heads: int | None = None,
    rope_scaling: Mapping[str, Any] | None = None,
    num_shards: int | None = None,
    with_tokenizer: bool = True,
    vocab_size: int | None = None,
    chat_template: str = "plain",
    dtype: str | None = None,
    device: str = "cpu",
) -> Path:
    """Write a random-weight checkpoint that transformers can load; return its folder.

    The same arguments always give byte-identical files on one kind of device. The folder
    gets config.json, generation_config.json, model.safetensors (or ``num_shards`` shards plus
    model.safetensors.index.json) and, with ``with_tokenizer``, tokenizer.json and
    tokenizer_config.json. Files an earlier call wrote to the folder are removed
    first, so a sharded and an unsharded checkpoint (or a stale tokenizer) never mix.

    Args:
        out_dir: destination folder, created if missing.
        preset: a key of ``presets.PRESETS`` ("tiny" for tests, "small" for benchmarks,
            "1b" and "8b" for Llama-3.2-1B's and Llama-3.1-8B's shapes, rope and vocabulary).
        arch: a key of ``presets.ARCHS``: "llama", "qwen2" or "mistral".
        seed: weight seed; each tensor's values depend only on the seed and its name.
        tie_word_embeddings: None takes the preset's, else the arch default (qwen2 tied,
            others untied).
        num_kv_heads: override the preset's KV head count (1 gives MQA); must divide
            the query head count.
        rope_scaling: an old-style rope scaling dict such as ``presets.LLAMA3_ROPE_SCALING``
            (None: the preset's, if any).
        num_shards: 1 writes model.safetensors; more writes HF-style shards and an index;
            None: as many as files of about 2 GiB take (1 for tiny and small).
        with_tokenizer: also write the shipped byte-level BPE tokenizer.
        vocab_size: override the preset's vocabulary (benchmarks of a 32,000-token head);
            tokenizers ship for 1,024, 8,192 and 32,000 tokens and are made for 128,256
            (tokenizer_files.py), any other size needs ``with_tokenizer=False``.
        chat_template: the tokenizer's chat template, a key of chat_templates.TEMPLATES:
            "plain" (role lines), or "qwen" / "llama3" (with tools support).
        dtype: the weights' precision, "float32" or "bfloat16" (None: the preset's).
        device: where the weights are drawn ("cuda" for a real size on a GPU machine: each
            file's tensors are drawn there and written, none of the whole model carried).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    shape, spec = PRESETS[preset], ARCHS[arch]
    if vocab_size is not None and vocab_size != shape.vocab_size:
        if with_tokenizer and vocab_size not in tokenizer_vocabs():
            raise ValueError(f"no tokenizer for a vocabulary of {vocab_size} (there are for "
                             f"{', '.join(map(str, tokenizer_vocabs()))}): pass "
                             "with_tokenizer=False")
        shape = dataclasses.replace(shape, vocab_size=vocab_size)
    kv_heads = shape.num_kv_heads if num_kv_heads is None else num_kv_heads
    if kv_heads < 1 or shape.num_heads % kv_heads:
        raise ValueError(f"num_kv_heads={kv_heads} must divide num_heads={shape.num_heads}")
    dtype = dtype or shape.dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_device(device)
    if tie_word_embeddings is None:
        tie_word_embeddings = shape.tie_word_embeddings
    tie = spec.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
    if rope_scaling is None:
        rope_scaling = shape.rope_scaling
    specs = weight_specs(shape, spec, kv_heads, tie)
    torch_dtype = DTYPES[dtype]
    item = torch_dtype.itemsize
    sizes = {name: (t.numel, t.numel * item) for name, t in specs.items()}
    if num_shards is None:
        num_shards = shards_needed(sum(nbytes for _, nbytes in sizes.values()))
    if not 1 <= num_shards <= len(specs):
        raise ValueError(f"num_shards must be in 1..{len(specs)}, got {num_shards}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Files an earlier call may have left: a folder must reflect exactly these arguments.
    for stale in [*out.glob("model*.safetensors"), *(out / name for name in OWN_FILES)]:
        stale.unlink(missing_ok=True)

    config = build_config(shape, spec, kv_heads, tie, rope_scaling, dtype)
    write_weights(sizes, lambda name: draw(seed, name, specs[name], torch_dtype, device),
                  out, num_shards)
    (out / "generation_config.json").write_bytes(dump_json(build_generation_config()))
    if with_tokenizer:
        write_tokenizer(out, shape.vocab_size, shape.max_position_embeddings, chat_template)
    # Last: a folder is a model once it has config.json (make-model --exist-ok says so), and
    # one whose making stopped midway (an 8B model's files take a while) is not.
    (out / "config.json").write_bytes(dump_json(config))
    return out


def check_device(device: str) -> None:
    """ValueError unless ``device`` is one weights can be drawn on here."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be cpu or cuda[:N], got {device!r}") from exc
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: no CUDA device here (make it with --device cpu, or on "
                         "the GPU machine)")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda[:N], got {device!r}")
