"""Sampling parameters shared by producers and workers, validated at the edge."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from producer.wire.response_format import canonical
from producer.wire.validation import MAX_TOKEN_ID, brief

# What does not go with a grammar (a response_format, a forced tool call): it ends the text
# where it is complete, so nothing may hold the text open past that (ignore_eos,
# min_tokens) or cut it before (a stop string or token: the JSON or call would not parse).
GRAMMAR_CONFLICTS = ("ignore_eos", "min_tokens", "stop", "stop_token_ids")


def grammar_conflict(value_of: Callable[[str], Any]) -> str | None:
    """The first of GRAMMAR_CONFLICTS that ``value_of`` (a field's name to its value) says
    is set; None where none is."""
    return next((name for name in GRAMMAR_CONFLICTS if value_of(name)), None)

# Limits that keep one request from exhausting a worker; each is a hard error, not a clamp.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
# Choices of one request: each is a request the worker that takes it serves.
MAX_CHOICES = 16
MAX_SEED = 2**63 - 1
# Beyond any model's context; a 32-bit int, like token ids and top_k below.
MAX_NEW_TOKENS = 2**31 - 1
# Any top_k at or above the vocabulary size keeps every token.
MAX_TOP_K = 2**31 - 1
# Below this a positive temperature is greedy decoding. The sampler divides float32 logits
# by the temperature: 1e-320 is 0 in float32 (logits / 0 is NaN), and anything under about
# 1e-35 overflows the scaled logits to inf. At 1e-5 the distribution is already one-hot for
# any logits that differ by more than 1e-3, so greedy is what such a request means.
MIN_TEMPERATURE = 1e-5
# Largest magnitude of any number field: an int beyond it overflows a float (and msgpack).
MAX_NUMBER = 2**63 - 1
# OpenAI's ranges: penalties in [-2, 2], a logit bias in [-100, 100] (-100 bans a token).
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# A repetition penalty divides positive logits (multiplies negative ones): 1 is off.
MAX_REPETITION_PENALTY = 10.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy decoding. A temperature below ``MIN_TEMPERATURE``
    (1e-5; e.g. 1e-320, which would underflow to NaN in the sampler) is treated as greedy:
    it is stored as 0.0, so the request, its wire form and the worker all see greedy.
    ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` each switch their filter off. A
    request with a ``seed`` gets the same tokens whatever batch it runs in and after any
    restart.

    Penalties change the logits before any of that (greedy requests too), counting the
    request's own output tokens: ``presence_penalty`` is subtracted once from every token
    already generated, ``frequency_penalty`` once per time it was (OpenAI's meaning);
    ``repetition_penalty`` (1 = off) divides the positive logits, and multiplies the
    negative ones, of every token in the prompt or the output (transformers' meaning).
    ``logit_bias`` maps token ids to a number added to their logits (-100 bans one).
    """

    # None: until the context is full, or the whole KV pool where it holds less (or a stop):
    # producer.wire.stopping.token_limit, the one rule.
    # The defaults are OpenAI's, and the same for Client.submit, `conveyor submit` and the
    # gateway (docs/protocol.md).
    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # Return this many most likely alternatives (plus the chosen token's) per token.
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs, sorted by id; given as a mapping (JSON keys may be strings).
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # The text leaves out the tokenizer's special tokens (vLLM's default); False keeps them.
    skip_special_tokens: bool = True
    # A stop string that ended the request stays at the end of its text (vLLM's field).
    include_stop_str_in_output: bool = False
    # Tokens generated before EOS or a stop token may be sampled, or a stop string may end
    # the request (vLLM's field): those tokens are kept out of the draw until then.
    min_tokens: int = 0
    # Log-probabilities of the prompt's tokens (each given the ones before it) and this many
    # most likely alternatives each, computed in the prefill (vLLM's field; the gateway's
    # ``echo``). The request then computes its whole prompt: no prefix-cache hit, no
    # imported KV.
    prompt_logprobs: int | None = None
    # Choices drawn for the prompt (OpenAI's field): the worker serves choice i as a request
    # of its own, seeded seed + i, streamed on its own output stream (docs/protocol.md);
    # they share the prompt's KV through the prefix cache.
    n: int = 1
    # What the text must be (producer/wire/response_format.py: a JSON object, a JSON value valid
    # against a schema, a regex, one of some strings): given as OpenAI's response_format
    # mapping, kept as its canonical JSON text. None: free text.
    response_format: str | None = None

    def __post_init__(self) -> None:
        # Lists arrive from JSON and msgpack; store tuples so params stay hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if not isinstance(value, list | tuple):
                raise ValueError(f"{name} must be a list, got {brief(value)}")
            object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "response_format", canonical(self.response_format))
        self._validate()
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes this request's logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        """Build from a plain mapping, rejecting unknown keys with a ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(brief(k) for k in set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown[:8])}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of lists and scalars, ready for msgpack or JSON."""
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        # String keys, as in OpenAI's JSON: msgpack readers refuse integer map keys by default.
        d["logit_bias"] = {str(token): bias for token, bias in self.logit_bias}
        # Only when set: a worker from before them refuses the fields, never a request that
        # leaves them at their defaults.
        for name, default in LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        if self.response_format is not None:
            d["response_format"] = json.loads(self.response_format)
        return d

    def _validate(self) -> None:
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1, high=MAX_NEW_TOKENS)
        _check_int("min_tokens", self.min_tokens, low=0, high=MAX_NEW_TOKENS)
        _check_int("n", self.n, low=1, high=MAX_CHOICES)
        if self.response_format is not None and (
                name := grammar_conflict(lambda field_name: getattr(self, field_name))):
            raise ValueError(f"{name} does not go with a response_format (or a forced tool "
                             "call): its grammar ends the text where it is complete")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens})")
        _check_float("temperature", self.temperature, low=0.0)
        _check_int("top_k", self.top_k, low=0, high=MAX_TOP_K)
        _check_float("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {brief(getattr(self, name))}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0, high=MAX_LOGPROBS)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"each stop string must be a non-empty str of at most "
                    f"{MAX_STOP_STRING_CHARS} characters, got {brief(s)}"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entry", t, low=0, high=MAX_TOKEN_ID)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), low=-MAX_ABS_PENALTY, high=MAX_ABS_PENALTY)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0,
                     high=MAX_REPETITION_PENALTY)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be > 0 (1 is off), got 0")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} logit_bias entries, "
                             f"got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            _check_int("logit_bias token id", token, low=0, high=MAX_TOKEN_ID)
            _check_float("logit_bias value", bias, low=-MAX_ABS_LOGIT_BIAS,
                         high=MAX_ABS_LOGIT_BIAS)


# Fields added after the first wire version, with their defaults: written only when set.
LATER_FIELDS = {"skip_special_tokens": True, "include_stop_str_in_output": False,
                "min_tokens": 0, "prompt_logprobs": None, "n": 1, "response_format": None}


def choice_params(params: SamplingParams, index: int, seed: int) -> SamplingParams:
    """Choice ``index``'s parameters of a request with ``params`` (n choices): one choice,
    seeded ``seed + index`` (``seed``: the request's, or the one its worker chose). Each
    choice that asks for prompt logprobs computes them (its first chunk carries them)."""
    return replace(params, n=1, seed=(seed + index) % (MAX_SEED + 1))


def _bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs, from a mapping or from pairs.

    Token ids may come as decimal strings (JSON object keys); nothing else is converted.
    """
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, list | tuple) and all(
            isinstance(p, list | tuple) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise ValueError(f"logit_bias must map token ids to numbers, got {brief(value)}")
    pairs: dict[int, Any] = {}
    for key, bias in items:
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
            key = int(key)
        if not isinstance(key, int) or isinstance(key, bool):
            raise ValueError(f"logit_bias keys must be token ids, got {brief(key)}")
        if key in pairs:
            raise ValueError(f"logit_bias names token {key} twice")
        if isinstance(bias, int) and not isinstance(bias, bool):
            _check_float("logit_bias value", bias)  # an int too large for a float
            bias = float(bias)
        pairs[key] = bias
    return tuple(sorted(pairs.items()))


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> None:
    # bool is an int subclass; True as max_tokens is a caller bug, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {brief(value)}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {brief(value)}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {brief(value)}")


def _check_float(name: str, value: Any, low: float | None = None,
                 high: float | None = None) -> None:
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or (isinstance(value, float) and not math.isfinite(value))
            or (isinstance(value, int) and abs(value) > MAX_NUMBER)):
        raise ValueError(f"{name} must be a finite number, got {brief(value)}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {brief(value)}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {brief(value)}")
