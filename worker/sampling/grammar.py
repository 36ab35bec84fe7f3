"""Structured outputs on the worker: a constrained request's grammar matcher (llguidance)
kept with its sampling row, a step's token masks made on the host before the forward and
applied in the sampler.

Each grammar is compiled once per worker (by the key of its canonical response_format,
producer/wire/response_format.py) and a request's matcher is a copy of the compiled one: a copy
costs microseconds where a compile can cost milliseconds. A matcher takes in every token
its request has (a resumed or recomputed request replays the ones it already has, so it goes
on in the grammar's state where it stopped), and each step's mask says which tokens may
come next: one bit a token, 32 a word, made by llguidance into one host array for the
step's constrained rows and staged in the step's upload. The sampler sets every other
token's logit to -inf, vectorised over those rows. Where the grammar is complete only the
model's EOS is allowed: the request ends ``stop``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from producer.wire.params import SamplingParams
from producer.wire.response_format import grammar_key, grammar_limits, grammar_of
from worker.host.cpu_kernels import mask_rows_kernel

# Compiled grammars kept by a worker (the least recently used go first).
MAX_CACHED_GRAMMARS = 256


class Grammars:
    """The model's tokens as llguidance sees them, and the grammars compiled for it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        from llguidance import LLTokenizer

        # The model's whole vocabulary (its logits' width), EOS as the model ends with it.
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                     eos_token=sorted(eos_token_ids))
        self.vocab_size = vocab_size
        # 32-bit words a mask row, an even number: a row travels as int64s in the upload.
        self.words = 2 * ((vocab_size + 63) // 64)
        self._compiled: OrderedDict[str, object] = OrderedDict()
        # Admission (the engine's thread) and the runner's thread both take matchers.
        self._lock = threading.Lock()
        # Counters (worker metrics, benchmarks): grammars compiled and the seconds it took,
        # formats found compiled, mask rows made and the seconds they took.
        self.compiles = 0
        self.compile_seconds = 0.0
        self.hits = 0
        self.mask_rows = 0
        self.mask_seconds = 0.0

    @classmethod
    def for_model(cls, model_dir: str | Path, vocab_size: int,
                  eos_token_ids: Sequence[int]) -> Grammars | None:
        """The model's grammars; None for a model without tokenizer.json (token ids only:
        no text to constrain)."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            return None
        return cls(path.read_text(encoding="utf-8"), vocab_size, eos_token_ids)

    def compile(self, form: str) -> None:
        """Compile ``form`` (a canonical response_format) unless it is compiled already;
        ValueError where the grammar cannot be served."""
        self._compiled_matcher(form)

    def matcher(self, form: str, tokens: Sequence[int] = ()):
        """A fresh matcher of ``form`` that has taken in ``tokens``; ValueError where the
        grammar cannot be served or the tokens leave it."""
        compiled = self._compiled_matcher(form)
        with self._lock:
            matcher = compiled.deep_copy()
        if tokens and not matcher.consume_tokens(list(tokens)):
            raise ValueError(f"the request's tokens leave its response_format: "
                             f"{matcher.get_error()[:500]}")
        return matcher

    def _compiled_matcher(self, form: str):
        """The compiled matcher of ``form`` (not to be advanced: ``matcher`` copies it)."""
        from llguidance import LLMatcher

        key = grammar_key(form)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                began = time.perf_counter()
                compiled = LLMatcher(self.tokenizer, grammar_of(form), log_level=0,
                                     limits=grammar_limits())
                self.compile_seconds += time.perf_counter() - began
                if compiled.is_error():
                    raise ValueError(f"response_format cannot be served: "
                                     f"{compiled.get_error()[:500]}")
                self._compiled[key] = compiled
                self.compiles += 1
                if len(self._compiled) > MAX_CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
                self.hits += 1
            return compiled

    def masks(self, matchers: Sequence, device: torch.device) -> torch.Tensor:
        """The next-token masks of ``matchers`` (one row each, ``words`` int32 a row) on
        ``device``: the model runner makes them once the step's forward is under way, so a
        device's forward runs meanwhile (the copy is queued behind it)."""
        began = time.perf_counter()
        mask = np.zeros((len(matchers), self.words), dtype=np.int32)
        row_bytes = self.words * 4
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data + i * row_bytes, row_bytes)
        self.mask_rows += len(matchers)
        self.mask_seconds += time.perf_counter() - began
        host = torch.from_numpy(mask)
        return host if device.type == "cpu" else host.to(device, non_blocking=True)

    def stats(self) -> dict[str, float]:
        """The counters, for the worker's metrics."""
        return {"grammar_compiles": self.compiles, "grammar_compile_seconds": self.compile_seconds,
                "grammar_cache_hits": self.hits, "grammar_mask_rows": self.mask_rows,
                "grammar_mask_seconds": self.mask_seconds}


def constrained(params: SamplingParams) -> bool:
    return params.response_format is not None


def apply_grammar(logits: torch.Tensor, rows: torch.Tensor | None,
                  mask: torch.Tensor | None) -> None:
    """Set to -inf, in place, every logit of the batch rows ``rows`` whose bit in that row's
    ``mask`` (int32 words, bit j of word w: token 32w + j) is clear.

    Float32 logits on the CPU: the mask_rows kernel (worker/host/csrc/mask_rows.cpp).
    Others take a bias of 0 or -inf with one index_add (a masked fill walks the logits
    element by element: at batch 64 and vocab 32,000 on this CPU, bits unpacked and
    masked_fill cost 7.3 ms, the bias 1.3 ms)."""
    if rows is None or mask is None:
        return
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and \
            logits.is_contiguous() and (kernel := mask_rows_kernel()) is not None:
        kernel(logits, rows, mask)  # (reads the mask word by word: no temporaries)
        return
    logits.index_add_(0, rows, _bias(mask, logits.shape[-1], logits.dtype))


def _bias(mask: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Each row's bias: 0 for a token whose bit is set, -inf for one whose bit is clear."""
    if mask.device.type == "cpu":
        # numpy unpacks bits with SIMD (little-endian words: byte b holds tokens 8b to
        # 8b + 7, bit k token 8b + k); a bit b becomes (b - 1) * -(-inf's bit pattern):
        # 0, or the pattern itself, read as the float.
        bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")
        ints, pattern = _NEG_INF_BITS[dtype]
        return torch.from_numpy(bits)[:, :vocab].to(ints).sub_(1).mul_(-pattern).view(dtype)
    table = _byte_bias(mask.device, dtype)  # (a device gathers: one lookup a byte)
    return table[mask.view(torch.uint8).long()].view(mask.shape[0], -1)[:, :vocab]


def _neg_inf_bits(dtype: torch.dtype, ints: torch.dtype) -> tuple[torch.dtype, int]:
    return ints, int(torch.tensor(float("-inf"), dtype=dtype).view(ints).item())


# -inf's bits as the signed integer of its width, by float dtype.
_NEG_INF_BITS = {dtype: _neg_inf_bits(dtype, ints) for dtype, ints in (
    (torch.float64, torch.int64), (torch.float32, torch.int32),
    (torch.float16, torch.int16), (torch.bfloat16, torch.int16))}


@functools.cache
def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """For each byte value, its eight tokens' bias: 0 where the bit is set, -inf where not."""
    clear = ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).eq(0)
    return torch.zeros(256, 8, dtype=dtype).masked_fill_(clear, float("-inf")).to(device)
