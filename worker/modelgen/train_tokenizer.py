"""Regenerate the shipped byte-level BPE tokenizers in worker/modelgen/data/.

Run as ``python -m worker.modelgen.train_tokenizer``. The corpus is the docstrings
parsed from the source of a fixed list of pure-Python standard-library modules, so
nothing is downloaded. Docstrings change between Python releases, so byte-identical
output needs the Python and tokenizers versions the shipped files were made with
(3.11.7, 0.23.3); the shipped files, not this script, are what checkpoints copy.

Docstrings hold about 10,000 tokens' worth of merges: the 32,000-token tokenizer (no
preset's; benchmarks of a Llama-2-sized vocabulary) is trained on them and on the whole
source of the standard library (every ``.py`` outside its tests and site-packages, in
path order), 13 MB of text.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from worker.modelgen.presets import (
    BOS_TOKEN,
    BOS_TOKEN_ID,
    PRESETS,
    SPECIAL_TOKENS,
    TOKENIZER_SHA256,
)
from worker.modelgen.tokenizer_files import DATA_DIR, EXTENDED_VOCABS, shipped_tokenizer_path

# Platform-neutral pure-Python modules with long English docstrings.
CORPUS_MODULES = tuple(
    """
    argparse ast asyncio.base_events asyncio.events asyncio.futures asyncio.locks
    asyncio.queues asyncio.streams asyncio.tasks base64 bisect calendar cmd code codecs
    collections colorsys configparser contextlib copy csv dataclasses datetime decimal
    difflib doctest email.message email.utils enum fractions ftplib functools getopt
    gettext glob gzip heapq hmac html.parser http.client http.cookiejar http.server
    imaplib inspect ipaddress json json.decoder json.encoder logging logging.handlers
    mailbox numbers operator optparse pathlib pdb pickle pickletools pprint queue quopri
    random re sched secrets selectors shlex shutil smtplib socketserver statistics
    string subprocess tarfile tempfile textwrap threading timeit tokenize trace
    traceback typing unittest.case unittest.mock urllib.parse urllib.request uuid
    warnings weakref xml.dom.minidom zipfile zipimport
    """.split()
)

# SHA-256 of the NUL-joined corpus the shipped tokenizers were trained on (Python 3.11.7).
CORPUS_SHA256 = "b191d168c47e0628a3e157c6dd8baf7ac93fcf7fe50e539358b92417446b62e8"
# Vocabularies trained on the larger corpus (docstrings and the standard library's source).
LARGE_VOCABS = (32000,)
LARGE_CORPUS_SHA256 = "f580ecfb923bcc93f30596ad60ed1bb93febdc52347d911676e6b40f57238e3a"
# Folders of the standard library left out of the larger corpus.
NOT_CORPUS = frozenset({"test", "tests", "idle_test", "site-packages"})


def iter_docstrings(module_name: str) -> Iterator[str]:
    """Yield every module, class and function docstring in a module's source, in source order."""
    # Parsed, not imported, so the corpus never depends on what else the process imported.
    base = Path(sysconfig.get_paths()["stdlib"]).joinpath(*module_name.split("."))
    source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    tree = ast.parse(source.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def build_corpus() -> list[str]:
    """The training texts: every docstring of CORPUS_MODULES, in a fixed order."""
    texts: list[str] = []
    for name in CORPUS_MODULES:
        texts.extend(iter_docstrings(name))
    return texts


def build_large_corpus() -> list[str]:
    """The larger corpus: every docstring, then every standard-library source file outside
    NOT_CORPUS, in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not NOT_CORPUS & set(p.relative_to(root).parts))
    return [*build_corpus(), *(p.read_text(encoding="utf-8", errors="replace")
                               for p in files)]


def train(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE whose first ids are SPECIAL_TOKENS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Exactly the template transformers rebuilds from add_bos_token=True, so both agree.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"corpus too small: got {tokenizer.get_vocab_size()} < {vocab_size}")
    return tokenizer


def main() -> None:
    """Train one tokenizer per preset vocab size and report whether each hash matches."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR)
    args = parser.parse_args()
    corpora = {}
    for name, texts, expected in (("corpus", build_corpus(), CORPUS_SHA256),
                                  ("large corpus", build_large_corpus(), LARGE_CORPUS_SHA256)):
        digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()
        # A corpus mismatch means another Python release; a tokenizer-only one, another
        # trainer.
        status = "matches" if digest == expected else "DIFFERS from"
        print(f"{name}: {len(texts)} texts, sha256 {digest} ({status} the recorded one)")
        corpora[name] = texts
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # (the larger vocabularies extend the 32,000-token one: tokenizer_files.py)
    shipped = {p.vocab_size for p in PRESETS.values()} - set(EXTENDED_VOCABS)
    for vocab_size in sorted(shipped | set(LARGE_VOCABS)):
        texts = corpora["large corpus" if vocab_size in LARGE_VOCABS else "corpus"]
        data = train(texts, vocab_size).to_str(pretty=False).encode()
        path = args.out_dir / shipped_tokenizer_path(vocab_size).name
        path.write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        status = "matches" if TOKENIZER_SHA256.get(vocab_size) == digest else "DIFFERS from"
        print(f"{path}: {len(data)} bytes, sha256 {digest} ({status} presets.TOKENIZER_SHA256)")


if __name__ == "__main__":
    main()
