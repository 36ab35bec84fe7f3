"""Structured outputs (``response_format``) on the engine with random weights: the grammar
does the work. Every answer parses and validates against its schema and ends ``stop``; a
regex and a choice hold; a request resumed after some of its tokens goes on in the
grammar's state to the same answer; formats are checked at the edge (no torch needed)."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
from structured_schemas import SCHEMAS

from worker import Engine, FinishReason, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(tiny_llama, dtype="float32", num_kv_blocks=1024, max_num_seqs=32)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                   "strict": True}}


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(rng.randint(3, 30))]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_answer_validates_and_stops(engine, name):
    schema = SCHEMAS[name]
    params = [SamplingParams(max_tokens=512, temperature=1.0, seed=i,
                             response_format=schema_format(schema)) for i in range(16)]
    done = engine.generate([prompt(i) for i in range(16)], params)
    for c in done:
        assert c.finish_reason is FinishReason.STOP, c.text
        jsonschema.validate(json.loads(c.text), schema)
        assert c.text == json.dumps(json.loads(c.text), separators=(",", ":"),
                                    ensure_ascii=False)  # compact


def test_an_answer_writes_its_properties_in_the_schemas_order(engine):
    """Keys in the order the schema declares them (a reasoning field before the answer it
    leads to, as OpenAI writes them), not sorted: the format's text keeps the order."""
    schema = {"type": "object", "properties": {
        "zeta": {"type": "string", "maxLength": 6},
        "alpha": {"type": "integer", "minimum": 0, "maximum": 99},
        "mid": {"type": "boolean"}}, "required": ["zeta", "alpha", "mid"],
        "additionalProperties": False}
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=i,
                             response_format=schema_format(schema)) for i in range(4)]
    assert '"zeta":{' in params[0].response_format.split('"alpha"')[0]
    for c in engine.generate([prompt(i) for i in range(4)], params):
        assert c.finish_reason is FinishReason.STOP, c.text
        assert list(json.loads(c.text)) == ["zeta", "alpha", "mid"], c.text


def test_json_object_regex_and_choice(engine):
    forms = [{"type": "json_object"}, {"type": "regex", "regex": r"[a-c]{2,4}-[0-9]{3}"},
             {"type": "choice", "choices": ["yes", "no", "maybe"]}]
    done = engine.generate([prompt(i) for i in range(3)], [
        SamplingParams(max_tokens=256, temperature=1.0, seed=3, response_format=f)
        for f in forms])
    # Any object: its keys and strings are unbounded, so a random model may not close it
    # within max_tokens; its tokens are a prefix the grammar accepts all the same.
    assert done[0].text.startswith("{")
    grammars = engine.checks.grammars
    grammars.matcher(SamplingParams(response_format=forms[0]).response_format,
                     done[0].token_ids)
    if done[0].finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(done[0].text), dict)
    assert re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", done[1].text)
    assert done[2].text in ("yes", "no", "maybe")
    assert [c.finish_reason for c in done[1:]] == [FinishReason.STOP] * 2


def test_a_resumed_request_goes_on_in_the_grammars_state(engine):
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=9,
                            response_format=schema_format(SCHEMAS["nested"]))
    (whole,) = engine.generate([prompt(5)], params)
    assert len(whole.token_ids) > 6  # precondition: there is a middle to resume from
    k = len(whole.token_ids) // 2
    rid = engine.add_request(prompt(5), params, generated_token_ids=whole.token_ids[:k])
    done = None
    while done is None:
        for out in engine.step():
            if out.request_id == rid and out.completion is not None:
                done = out.completion
    assert done.token_ids == whole.token_ids and done.text == whole.text


def test_formats_are_checked_at_the_edge():
    for bad, words in [({"type": "json_schema"}, "must be an object with a schema"),
                       ({"type": "xml"}, "type must be one of"),
                       ({"type": "regex", "regex": "(("}, "cannot be served"),
                       ({"type": "choice", "choices": []}, "choices must be"),
                       ({"type": "json_object", "extra": 1}, "unknown field")]:
        with pytest.raises(ValueError, match=words):
            SamplingParams(response_format=bad)
    # What would hold the grammar's text open past its end, or cut it before.
    for conflict in [{"ignore_eos": True}, {"min_tokens": 2}, {"stop": ['","']},
                     {"stop_token_ids": [7]}]:
        with pytest.raises(ValueError, match=f"^{next(iter(conflict))} does not go with"):
            SamplingParams(response_format={"type": "json_object"}, **conflict)
    assert SamplingParams(response_format={"type": "json_object"}, stop=[]).stop == ()
    # Text that is not Unicode (a lone surrogate, valid as a JSON escape) is refused as the
    # format's, never a codec's error deeper down.
    for bad in [{"type": "choice", "choices": ["a\ud800"]}, {"type": "regex", "regex": "\udc00"},
                {"type": "json_schema", "json_schema": {"name": "x\ud800",
                                                        "schema": {"enum": ["\ud800"]}}}]:
        with pytest.raises(ValueError, match="^response_format holds text that is not Unicode"):
            SamplingParams(response_format=bad)
    with pytest.raises(ValueError, match="type 'text' takes no other field; got 'whitespace'"):
        SamplingParams(response_format={"type": "text", "whitespace": "flexible"})
    deep: dict = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ValueError, match="nests deeper"):
        SamplingParams(response_format=schema_format(deep))
    assert SamplingParams(response_format={"type": "text"}).response_format is None


def test_overlapped_steps_hold_the_grammar_too(tiny_llama):
    """The runner thread takes each step's tokens into the matchers before it masks the
    next step: overlapped steps give the same answers as plain ones."""
    form = schema_format(SCHEMAS["nested"])
    params = [SamplingParams(max_tokens=300, temperature=1.0, seed=i, response_format=form)
              for i in range(6)]
    plain = Engine(tiny_llama, dtype="float32", num_kv_blocks=512).generate(
        [prompt(i) for i in range(6)], params)
    overlapped = Engine(tiny_llama, dtype="float32", num_kv_blocks=512,
                        async_scheduling=True)
    done = overlapped.generate([prompt(i) for i in range(6)], params)
    assert overlapped.num_overlapped_steps > 0  # precondition
    assert [c.token_ids for c in done] == [c.token_ids for c in plain]
    for c in done:
        jsonschema.validate(json.loads(c.text), SCHEMAS["nested"])


def test_a_simulated_engine_refuses_a_response_format(tiny_llama):
    engine = Engine(tiny_llama, simulate_step_ms=0.0)
    with pytest.raises(ValueError, match="simulated"):
        engine.add_request([1, 2, 3], SamplingParams(response_format={"type": "json_object"}))


def test_a_killed_worker_constrained_stream_resumes_to_the_same_valid_answer(
        redis_url, tiny_llama, tmp_path):
    """The worker serving a constrained request is SIGKILLed mid-stream: the other takes it
    over, replays the grammar from the published tokens and ends with the undisturbed
    run's tokens, valid against the schema."""
    import signal
    import time

    from fleet_fixtures import MODEL, settled_pending
    from worker_processes import spawn_worker, stop_all, wait_ready

    from producer.client.client import Client
    from producer.wire.keys import GROUP, Keys
    from producer.wire.protocol import FIELD, FinalEntry, decode_output

    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400,
                                                         "maxLength": 600}},
              "required": ["text"], "additionalProperties": False}
    params = {"max_tokens": 1500, "temperature": 1.0, "seed": 21,
              "response_format": schema_format(schema)}
    (want,) = Engine(tiny_llama, dtype="float64", num_kv_blocks=512).generate(
        [prompt(7)], SamplingParams(**params))
    assert want.finish_reason is FinishReason.STOP  # precondition: a whole answer
    client = Client(redis_url)
    procs = {name: spawn_worker(tiny_llama, redis_url, name, "--lease-ms", "1500",
                                log_dir=tmp_path) for name in ("a", "b")}
    try:
        for name, proc in procs.items():
            wait_ready(client, name, proc)
        rid = client.submit(prompt(7), model=MODEL, **params)
        stream = Keys().output(rid)
        deadline = time.monotonic() + 60
        while client.redis.xlen(stream) < 3:
            assert time.monotonic() < deadline, "no tokens came"
            time.sleep(0.005)
        lane = Keys().requests(MODEL, "interactive")
        (held,) = client.redis.xpending_range(lane, GROUP, "-", "+", 10)
        victim = held["consumer"]
        victim = victim.decode() if isinstance(victim, bytes) else victim
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(timeout=10)
        last = client.redis.xrevrange(stream, count=1)[0][1][FIELD]
        assert not isinstance(decode_output(last), FinalEntry)  # precondition: mid-stream
        got = client.result(rid, timeout=120)
        assert got.token_ids == want.token_ids and got.finish_reason == "stop"
        jsonschema.validate(json.loads(got.text), schema)
        assert settled_pending(client.redis) == 0
    finally:
        stop_all(list(procs.values()))


def test_a_worker_compiles_each_format_once_off_its_engine_thread(start_worker, redis_url):
    """Two requests of one format and one of another: two compiles (on the intake's
    thread, when each is read), the engine's admissions find them compiled; the metrics
    count them and the masks made."""
    from fleet_fixtures import MODEL

    from producer.client.client import Client

    worker = start_worker()
    forms = [schema_format(SCHEMAS["flat"]), schema_format(SCHEMAS["flat"]),
             {"type": "choice", "choices": ["yes", "no"]}]
    with Client(redis_url) as client:
        done = [client.result(client.submit([5, 6, 7], model=MODEL, max_tokens=32,
                                            temperature=1.0, seed=i, response_format=f),
                              timeout=60) for i, f in enumerate(forms)]
    assert [c.finish_reason for c in done] == ["stop"] * 3
    stats = worker.engine.stats()
    assert stats["grammar_compiles"] == 2
    assert stats["grammar_cache_hits"] >= 4  # the second read, and every admission
    assert stats["grammar_mask_rows"] >= sum(len(c.token_ids) for c in done)
    assert stats["grammar_compile_seconds"] > 0 and stats["grammar_mask_seconds"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 1024, 8191])
def test_the_mask_blocks_exactly_the_clear_bits(dtype, vocab, kernels_built):
    """apply_grammar (the mask_rows kernel for float32, else a bias: numpy's unpacked bits
    on a CPU, the byte table on a device) leaves the tokens whose bit is set and makes the
    others -inf, in the rows named only, as a masked fill of the unpacked bits would."""
    from worker.sampling.grammar import _bias, _byte_bias, apply_grammar

    words = 2 * ((vocab + 63) // 64)
    mask = torch.randint(-2**31, 2**31 - 1, (4, words), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(vocab))
    mask[:, ::3] = -1  # (words of every token allowed, and of none: the kernel's shortcuts)
    mask[:, 1::5] = 0
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    rows = torch.tensor([0, 2, 5, 6])
    bits = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1)
    allowed = bits.reshape(4, -1)[:, :vocab].bool()
    want = logits.clone()
    want[rows] = want[rows].masked_fill(~allowed, float("-inf"))
    got = logits.clone()
    apply_grammar(got, rows, mask)
    assert torch.equal(got, want)
    table = _byte_bias(torch.device("cpu"), dtype)  # the device path's table
    on_device = logits.clone().index_add_(
        0, rows, table[mask.view(torch.uint8).long()].view(4, -1)[:, :vocab])
    assert torch.equal(on_device, want)
    assert torch.equal(logits.clone().index_add_(0, rows, _bias(mask, vocab, dtype)), want)


def test_the_compilers_budgets_are_ours(monkeypatch, tiny_llama):
    """The grammar compiler works within conveyor's budgets (response_format's COMPILE_FUEL
    and the rest), at the edge and in a worker's compile alike: one past them is refused."""
    from producer.wire import response_format
    from worker.sampling.grammar import Grammars

    form = {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"mail": {"type": "string",
                                                  "pattern": "^[a-z]{3,9}@[a-z]+$"}}}}}
    text = response_format.canonical(form)
    limits = response_format.grammar_limits()
    assert (limits.initial_lexer_fuel, limits.step_lexer_fuel) == (
        response_format.COMPILE_FUEL, response_format.STEP_FUEL)
    monkeypatch.setattr(response_format, "COMPILE_FUEL", 100)
    with pytest.raises(ValueError, match="too big"):
        response_format.canonical(form)
    grammars = Grammars.for_model(tiny_llama, 1024, [0])
    with pytest.raises(ValueError, match="cannot be served"):
        grammars.compile(text)


def test_a_grammar_that_fails_mid_answer_ends_its_request_with_an_error(monkeypatch,
                                                                        tiny_llama):
    """A grammar past its budget mid-answer (a mask's fuel spent) allows only the end: the
    request ends with an error saying so, never a cut answer as a stop; the others of the
    batch go on."""
    from producer.wire import response_format

    schema = {"type": "object", "properties": {"mail": {
        "type": "string", "pattern": "^[a-z]{3,9}@[a-z]{2,9}$"}}, "required": ["mail"],
        "additionalProperties": False}
    held = SamplingParams(max_tokens=64, temperature=1.0, seed=3,
                          response_format=schema_format(schema))
    free = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    whole = Engine(tiny_llama, dtype="float32", num_kv_blocks=256).generate([prompt(1)], held)
    assert whole[0].finish_reason == FinishReason.STOP  # precondition: within the budgets
    jsonschema.validate(json.loads(whole[0].text), schema)
    monkeypatch.setattr(response_format, "STEP_FUEL", 20)  # (read when a grammar compiles)
    failed, other = Engine(tiny_llama, dtype="float32", num_kv_blocks=256).generate(
        [prompt(1), prompt(2)], [held, free])
    assert failed.finish_reason == FinishReason.ERROR
    assert "grammar failed" in failed.error
    assert other.finish_reason == FinishReason.LENGTH and len(other.token_ids) == 8
