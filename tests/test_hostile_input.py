"""Hostile input: thousands of malformed request entries never take a worker down.

Hypothesis generates the entries: random bytes, msgpack values that are not maps, request
maps with one or two things broken (wrong types, huge or negative numbers, bad ids,
unknown or missing fields, nested junk), entries without the message field and nesting
as deep as Python's recursion limit. Each broken thing is invalid on its own, so every
entry is malformed; the test decodes each one first and fails if the generator made a
valid request after all.
"""

from __future__ import annotations

import math
import time

import msgpack
import pytest
from fleet_fixtures import MODEL, settled_pending
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from producer.client.client import Client
from producer.wire.keys import LANES, Keys
from producer.wire.params import MAX_LOGPROBS, MAX_NEW_TOKENS, MAX_SEED, MAX_TOP_K, SamplingParams
from producer.wire.protocol import (
    FIELD,
    MAX_ENTRY_BYTES,
    MAX_UNIX_MS,
    REQUEST_FIELDS,
    GenerationRequest,
    ProtocolError,
)
from producer.wire.validation import MAX_TOKEN_ID, REQUEST_ID_PATTERN

KEYS = Keys()
STREAM = KEYS.requests(MODEL, "interactive")
PARAM_NAMES = frozenset(SamplingParams().to_dict())
# Hypothesis examples, each a batch of entries: 80 x (20..28 + 6..10) is over 2,000 entries.
EXAMPLES, BROKEN_PER_BATCH, OTHERS_PER_BATCH = 80, (20, 28), (6, 10)
MIN_ENTRIES = 2000

# --- strategies ------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=24), st.binary(max_size=24),
)
JUNK = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=6,
)


def _is_int(x: object) -> bool:
    return type(x) is int


def _is_number(x: object) -> bool:
    return type(x) is int or (type(x) is float and math.isfinite(x))


NOT_INT = JUNK.filter(lambda x: not _is_int(x))
NOT_INT_OR_NONE = NOT_INT.filter(lambda x: x is not None)
NOT_NUMBER = JUNK.filter(lambda x: not _is_number(x))
NOT_STR = JUNK.filter(lambda x: type(x) is not str)
HUGE = st.integers(MAX_TOKEN_ID + 1, 2**64 - 1)
NEGATIVE = st.integers(-(2**63), -1)


def ints_outside(low: int, high: int) -> st.SearchStrategy[int]:
    below = st.integers(-(2**63), low - 1) if low > -(2**63) else st.nothing()
    return below | st.integers(high + 1, max(high + 1, 2**64 - 1))


# Finite floats below zero (not -0.0, which equals 0.0) and above one.
NEGATIVE_FLOAT = st.floats(max_value=-1e-6, allow_infinity=False)
ABOVE_ONE = st.floats(min_value=1.000001, allow_infinity=False)


def is_valid_token_ids(x: object) -> bool:
    return isinstance(x, list) and bool(x) and all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID
                                                   for t in x)


BAD_ID = NOT_STR | st.text(max_size=80).filter(lambda s: not REQUEST_ID_PATTERN.fullmatch(s))
BAD_STOP_STRING = NOT_STR | st.just("") | st.text(min_size=257, max_size=300)

# One invalid value per sampling parameter.
BAD_PARAM = {
    "max_tokens": NOT_INT_OR_NONE | ints_outside(1, MAX_NEW_TOKENS),  # None: the default
    "temperature": NOT_NUMBER | NEGATIVE_FLOAT | st.integers(-(2**63), -1),
    "top_k": NOT_INT | ints_outside(0, MAX_TOP_K),
    "top_p": NOT_NUMBER | NEGATIVE_FLOAT | ABOVE_ONE | st.sampled_from([0, 0.0, -0.0, 2]),
    "min_p": NOT_NUMBER | NEGATIVE_FLOAT | ABOVE_ONE,
    "seed": NOT_INT_OR_NONE | ints_outside(0, MAX_SEED),
    "stop": (JUNK.filter(lambda x: not isinstance(x, list | str))
             | st.lists(st.text(min_size=1, max_size=8), min_size=17, max_size=20)
             | st.tuples(st.lists(st.text(min_size=1, max_size=8), max_size=3),
                         BAD_STOP_STRING).map(lambda t: [*t[0], t[1]])),
    "stop_token_ids": (JUNK.filter(lambda x: not isinstance(x, list))
                       | st.lists(st.integers(0, 100), min_size=65, max_size=70)
                       | st.lists(NOT_INT | ints_outside(0, MAX_TOKEN_ID), min_size=1,
                                  max_size=3)),
    "ignore_eos": JUNK.filter(lambda x: type(x) is not bool),
    "logprobs": NOT_INT_OR_NONE | ints_outside(0, MAX_LOGPROBS),
}
BAD_PARAMS = st.one_of(
    JUNK.filter(lambda x: x is not None and not isinstance(x, dict)),
    st.dictionaries(st.text(max_size=12).filter(lambda k: k not in PARAM_NAMES), JUNK,
                    min_size=1, max_size=3),
    st.dictionaries(st.binary(min_size=1, max_size=8), JUNK, min_size=1, max_size=2),
    st.sampled_from(sorted(BAD_PARAM)).flatmap(
        lambda name: BAD_PARAM[name].map(lambda value: {name: value})),
)

# One invalid value per request field (token ids are invalid themselves, not only as a
# second prompt: another corruption may delete the text prompt).
BAD_FIELD = {
    "v": NOT_INT | st.integers(-(2**63), 2**64 - 1).filter(lambda v: v != 1),
    "id": BAD_ID,
    "model": NOT_STR | st.text(max_size=140).filter(lambda s: s != MODEL),
    "prompt": NOT_STR.filter(lambda x: x is not None) | st.just(""),
    "prompt_token_ids": (JUNK.filter(lambda x: x is not None and not is_valid_token_ids(x))
                         | st.lists(NEGATIVE | HUGE, min_size=1, max_size=4)),
    "params": BAD_PARAMS,
    "priority": NOT_INT | ints_outside(-1000, 1000),
    "lane": JUNK.filter(lambda x: not (type(x) is str and x in LANES)),
    "created_ms": NOT_INT | ints_outside(0, MAX_UNIX_MS),
    "deadline_ms": NOT_INT_OR_NONE | ints_outside(0, MAX_UNIX_MS),
}
REQUIRED = ("v", "id", "model", "prompt")


@st.composite
def base_request(draw) -> dict:
    """A valid request for the served model; corruptions below break it."""
    return {
        "v": 1,
        "id": draw(st.from_regex(REQUEST_ID_PATTERN, fullmatch=True)),
        "model": MODEL,
        "prompt": draw(st.text(min_size=1, max_size=20)),
        "params": {"max_tokens": 2, "temperature": 0},
        "priority": draw(st.integers(-1000, 1000)),
        "lane": draw(st.sampled_from(LANES)),
        "created_ms": draw(st.integers(0, MAX_UNIX_MS)),
        "deadline_ms": None,
    }


def corruption() -> st.SearchStrategy:
    """A function that breaks a request map in place, in one way that is invalid alone."""
    def setter(name: str):
        return BAD_FIELD[name].map(lambda value: lambda m: m.__setitem__(name, value))

    def deleter(name: str):
        return st.just(lambda m: m.pop(name, None))

    def unknown_field():
        return st.tuples(st.text(max_size=12).filter(lambda k: k not in REQUEST_FIELDS),
                         JUNK).map(lambda kv: lambda m: m.__setitem__(*kv))

    return st.one_of(
        st.sampled_from(sorted(BAD_FIELD)).flatmap(setter),
        st.sampled_from(REQUIRED).flatmap(deleter),
        unknown_field(),
    )


@st.composite
def broken_request(draw) -> dict[bytes, bytes]:
    request = draw(base_request())
    for breaks in draw(st.lists(corruption(), min_size=1, max_size=2)):
        breaks(request)
    return {FIELD: msgpack.packb(request, use_bin_type=True)}


@st.composite
def deeply_nested(draw) -> dict[bytes, bytes]:
    """A request map whose id, prompt or params is nested about as deep as Python's
    recursion limit (msgpack itself refuses more than 1024 levels)."""
    depth = draw(st.integers(900, 1023) | st.integers(1024, 3000))
    field = draw(st.sampled_from([b"\xa2id", b"\xa6prompt", b"\xa6params"]))
    deep = b"\x91" * depth + b"\xc0"
    return {FIELD: b"\x82\xa1v\x01" + field + deep}


NOT_REQUESTS = st.one_of(
    st.binary(max_size=200).map(lambda b: {FIELD: b}),
    JUNK.filter(lambda x: not isinstance(x, dict)).map(
        lambda x: {FIELD: msgpack.packb(x, use_bin_type=True)}),
    st.dictionaries(st.binary(min_size=1, max_size=4).filter(lambda k: k != FIELD),
                    st.binary(max_size=30), min_size=1, max_size=3),
    deeply_nested(),
)
# Mostly broken requests: they reach the deepest checks.
BATCHES = st.tuples(
    st.lists(broken_request(), min_size=BROKEN_PER_BATCH[0], max_size=BROKEN_PER_BATCH[1]),
    st.lists(NOT_REQUESTS, min_size=OTHERS_PER_BATCH[0], max_size=OTHERS_PER_BATCH[1]),
).map(lambda kinds: kinds[0] + kinds[1])


def generate_entries() -> list[dict[bytes, bytes]]:
    generated: list[dict[bytes, bytes]] = []

    @settings(max_examples=EXAMPLES, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(BATCHES)
    def collect(batch: list[dict[bytes, bytes]]) -> None:
        generated.extend(batch)

    collect()
    return generated


# --- the test --------------------------------------------------------------------------------


def is_servable(fields: dict[bytes, bytes]) -> bool:
    """Whether a worker of MODEL would serve this entry (what the generator must never make)."""
    try:
        return GenerationRequest.decode(fields.get(FIELD)).model == MODEL
    except ProtocolError:
        return False


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_thousands_of_malformed_entries_are_dead_lettered_and_the_worker_keeps_serving(
    redis_url, redis_client, start_worker
):
    entries = generate_entries()
    # Larger than any entry may be: refused before it is even unpacked.
    oversized = {FIELD: b"\xdb" + (MAX_ENTRY_BYTES + 16).to_bytes(4, "big")
                 + b"x" * (MAX_ENTRY_BYTES + 16)}
    entries += [oversized]
    assert len(entries) > MIN_ENTRIES
    servable = [e for e in entries if is_servable(e)]
    assert servable == [], "the generator made valid requests"

    worker = start_worker()
    threads = [worker.intake, worker.loop, worker.publisher, worker.cancels, worker.heartbeat]
    ids: list[str] = []
    for start in range(0, len(entries), 200):
        pipe = redis_client.pipeline(transaction=False)
        for fields in entries[start:start + 200]:
            pipe.xadd(STREAM, fields)
        ids += [i.decode() for i in pipe.execute()]

    wait_for(lambda: redis_client.xlen(KEYS.dead) >= len(ids), 60, "every entry dead-lettered")
    dead = redis_client.xrange(KEYS.dead)
    by_entry = {f[b"entry_id"].decode(): f for _id, f in dead}
    assert len(dead) == len(ids) and set(by_entry) == set(ids)
    assert all(f[b"reason"] and f[b"stream"].decode() == STREAM for f in by_entry.values())
    assert settled_pending(redis_client, MODEL) == 0
    assert all(t.is_alive() for t in threads), [t.name for t in threads if not t.is_alive()]

    with Client(redis_url) as client:
        good = client.submit("A good request after all that", model=MODEL, max_tokens=4,
                             temperature=0, ignore_eos=True)
        done = client.result(good, timeout=30)
    assert done.finish_reason == "length" and len(done.token_ids) == 4
    assert all(t.is_alive() for t in threads)
