"""`conveyor gateway` through the official openai client (and plain HTTP where the client
hides the wire): a real worker, a real Redis, a real uvicorn server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fleet_fixtures import MODEL
from gateway_fixtures import serve_gateway
from waiting import eventually

from producer.client.client import Client
from producer.client.queues import lane_stats
from producer.wire.keys import Keys

KEYS = Keys()
PROMPT = "The river ran past the old stone bridge"
COMPLETIONS = "/completions"
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Where does the river run?"}]


@pytest.fixture
def oai(gateway):
    with openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
def client(redis_url):
    with Client(redis_url) as c:
        yield c


def test_completions_and_chat_equal_the_client_streamed_or_not(start_worker, oai, client):
    start_worker()
    ref = client.result(client.submit(PROMPT, model=MODEL, max_tokens=8, temperature=0),
                        timeout=60)
    chat_ref = client.result(client.submit(model=MODEL, messages=MESSAGES, max_tokens=8,
                                           temperature=0), timeout=60)

    done = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert done.choices[0].text == ref.text
    assert done.choices[0].finish_reason == "length" == str(ref.finish_reason)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) \
        == (ref.usage.prompt_tokens, 8, ref.usage.prompt_tokens + 8)

    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == chat_ref.text
    assert chat.usage.prompt_tokens == chat_ref.usage.prompt_tokens
    assert chat.usage.completion_tokens == 8

    pieces, usage = [], None
    for chunk in oai.chat.completions.create(model=MODEL, messages=MESSAGES,
                                             max_completion_tokens=8, temperature=0,
                                             stream=True,
                                             stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            last_reason = chunk.choices[0].finish_reason
        else:
            usage = chunk.usage
    assert "".join(pieces) == chat_ref.text and last_reason == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (chat_ref.usage.prompt_tokens, 8)

    text = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert text == ref.text


def test_logprobs_come_back_in_openai_shapes(start_worker, oai):
    start_worker()
    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    done = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and all(len(top) == 3 for top in lp.top_logprobs)


def test_a_client_gone_mid_stream_cancels_its_request(start_worker, gateway, client):
    start_worker()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, \
            http.stream("POST", gateway.api + "/completions", json=body) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None  # tokens did flow
    final = client.result(request_id, timeout=60)
    assert str(final.finish_reason) == "cancelled"
    assert 0 < final.usage.completion_tokens < 400


def test_unsupported_fields_are_400s_naming_them(start_worker, oai):
    start_worker()
    cases = [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
         "tools"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"n": 17}, "n"),
        ({"extra_body": {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}},
         "messages"),
        ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
        ({"extra_body": {"guided_json": {}}}, "guided_json"),
        ({"temperature": -1}, "temperature"),
        # (messages that do not begin with the field's name)
        ({"stop": [""]}, "stop"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"extra_body": {"stop_token_ids": list(range(65))}}, "stop_token_ids"),
    ]
    for extra, field in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **extra)
        error = refused.value.body
        assert error["param"] == field, (field, error)
        assert field in error["message"] and error["type"] == "invalid_request_error"
    for prompt in ([2**40], [10**6]):  # past what an id may be; outside the vocabulary
        with pytest.raises(openai.BadRequestError) as refused:
            oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert refused.value.body["param"] == "prompt", refused.value.body


def test_unknown_model_is_404_and_a_model_without_live_workers_503(start_worker, oai, gateway):
    with pytest.raises(openai.NotFoundError) as missing:
        oai.completions.create(model="nobody", prompt="x", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found"
    worker = start_worker()
    assert [m.id for m in oai.models.list()] == [MODEL]
    worker.stop(drain_timeout_s=5)  # registered still; no live worker
    assert oai.models.list().data == []
    with pytest.raises(openai.InternalServerError) as unserved:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert unserved.value.status_code == 503
    assert unserved.value.body["code"] == "no_live_worker"


def test_a_wrong_api_key_is_401(redis_url, start_worker):
    start_worker()
    with serve_gateway(redis_url, api_keys=("right-key",)) as running:
        with openai.OpenAI(base_url=running.api, api_key="wrong", max_retries=0) as bad, \
                pytest.raises(openai.AuthenticationError) as refused:
            bad.models.list()
        assert refused.value.body["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=running.api, api_key="right-key", max_retries=0) as good:
            assert good.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                           temperature=0).usage.completion_tokens == 2
        assert httpx.get(running.url + "/health").json() == {"status": "ok", "in_flight": 0,
                                                             "busy": False}


def test_a_full_queue_is_429_with_retry_after(redis_url, start_worker, client, redis_client):
    # One slot, no prefetch: a long request holds the worker, the next one waits in the lane.
    start_worker(prefetch=0, max_num_seqs=1)
    long = client.submit(PROMPT, model=MODEL, max_tokens=2000, temperature=0, ignore_eos=True)
    eventually(lambda: lane_stats(redis_client, KEYS, MODEL)[0].pending == 1,
               "the long request taken")
    waiting = client.submit(PROMPT, model=MODEL, max_tokens=2)
    interactive = lane_stats(redis_client, KEYS, MODEL)[0]
    assert (interactive.pending, interactive.depth) == (1, 1)  # the precondition: 2 waiting
    with serve_gateway(redis_url, max_queue=2) as running:
        response = httpx.post(running.api + "/completions",
                              json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["code"] == "queue_full"
        assert error["message"] == (f"model {MODEL!r} has 2 requests waiting, the most this "
                                    "gateway queues is 2: try again later")
        assert "conveyor:" not in error["message"]  # no internal key
        with openai.OpenAI(base_url=running.api, api_key="k", max_retries=0) as oai, \
                pytest.raises(openai.RateLimitError):
            oai.completions.create(model=MODEL, prompt="x", max_tokens=2)
    client.cancel(long)
    assert client.result(waiting, timeout=60).usage.completion_tokens == 2


def test_health_metrics_and_errors_outside_the_api(start_worker, gateway, oai):
    start_worker()
    oai.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    page = httpx.get(gateway.url + "/metrics").text
    assert 'conveyor_gateway_requests_total{endpoint="/v1/completions",status="200"} 1.0' \
        in page
    missing = httpx.get(gateway.url + "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    bad_json = httpx.post(gateway.api + "/completions", content=b"{not json")
    assert bad_json.status_code == 400 and bad_json.json()["error"]["message"]


def test_a_field_named_with_a_lone_surrogate_is_a_400_and_the_connection_serves_on(gateway):
    # Valid JSON ("\ud800" is an escape JSON allows) that UTF-8 cannot write back: the 400
    # naming it is written with non-ASCII escaped, not failed as a 500 that drops the socket.
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "max_tokens": 2, "\\ud800": 1}'
    with httpx.Client() as http:  # one kept-alive connection for both requests
        refused = http.post(gateway.api + "/completions", content=body,
                            headers={"Content-Type": "application/json"})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "\ud800"
        assert http.get(gateway.api + "/models").status_code == 200
    page = httpx.get(gateway.url + "/metrics").text
    assert 'conveyor_gateway_requests_total{endpoint="/v1/completions",status="400"} 1.0' \
        in page


def test_an_error_after_streaming_began_is_an_event_before_done(start_worker, gateway):
    # A prompt within the context but larger than the worker's whole KV pool (4 blocks of
    # 16): only the worker can tell, once the request is queued.
    start_worker(num_kv_blocks=4)
    body = {"model": MODEL, "prompt": [7] * 100, "max_tokens": 4, "stream": True}
    response = httpx.post(gateway.api + "/completions", json=body, timeout=60)
    assert response.status_code == 200  # the status line went out before the worker answered
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "KV pool" in error["message"] and error["code"] == "request_failed"


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_context_is_a_400_before_it_is_queued(start_worker, gateway, client,
                                                                 stream):
    """The gateway counts the prompt's tokens with the model's registered tokenizer and
    chat template: over the context (2,048 for the tiny model) it answers 400, streamed or
    not (vLLM's answer), and queues nothing."""
    start_worker()
    lane = KEYS.requests(MODEL, "interactive")
    queued_before = client.redis.xlen(lane)
    long_text = "the river ran past the old stone bridge " * 400
    cases = [(COMPLETIONS, {"prompt": [7] * 2100}, "prompt"),
             (COMPLETIONS, {"prompt": long_text}, "prompt"),
             ("/chat/completions", {"messages": [{"role": "user", "content": long_text}]},
              "messages")]
    for url, fields, param in cases:
        response = httpx.post(gateway.api + url, json={
            "model": MODEL, "max_tokens": 4, "stream": stream, **fields}, timeout=60)
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == param
        assert "max length is 2048 tokens" in error["message"]
    assert client.redis.xlen(lane) == queued_before  # none queued


def test_bodies_that_cannot_be_read_are_400s_and_counted(start_worker, gateway):
    start_worker()
    url = gateway.api + "/completions"
    cases = [
        ("[" * 50_000 + "]" * 50_000, "not JSON we read"),  # nested past the parser
        ('{"model": "tiny", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}", "not JSON"),
        ('{"model": "tiny", "prompt": "x", "temperature": 1' + "0" * 30 + "}",
         "temperature must be a finite number"),
        ('{"model": "tiny", "prompt": "x", "logit_bias": {"1": 1' + "0" * 400 + "}}",
         "logit_bias value must be a finite number"),
    ]
    for body, message in cases:
        response = httpx.post(url, content=body.encode(), timeout=30)
        assert response.status_code == 400, (body[:60], response.text[:200])
        assert message in response.json()["error"]["message"]
    huge = httpx.post(url, content=b" " * (17 * 2**20), timeout=60)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "body_too_large"
    page = httpx.get(gateway.url + "/metrics").text
    assert 'conveyor_gateway_requests_total{endpoint="/v1/completions",status="400"} 4.0' \
        in page


def test_a_failed_request_names_its_id_and_a_model_can_be_retrieved(start_worker, gateway,
                                                                    oai, client):
    start_worker(num_kv_blocks=4)  # 64 tokens of KV: the worker refuses 100 of prompt
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nobody")
    response = httpx.post(gateway.api + "/completions", timeout=60,
                          json={"model": MODEL, "prompt": [7] * 100, "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["code"] == "request_failed"
    failed = client.result(response.headers["x-request-id"], timeout=10)
    assert str(failed.finish_reason) == "error"


def test_logprob_tokens_spell_the_answer_streamed_or_not(start_worker, oai):
    start_worker()
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "logprobs": 1}
    whole = oai.completions.create(**args)
    lp = whole.choices[0].logprobs
    # (a model may also write bytes that are no UTF-8 at all: the text has U+FFFD there,
    # one for a run the tokenizer's decoder reads as one, so those are left out)
    text = whole.choices[0].text
    joined = b"".join(map(token_bytes, lp.tokens)).decode("utf-8", "replace")
    assert joined.replace("\ufffd", "") == text.replace("\ufffd", "")
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    streamed = [c.choices[0].logprobs for c in oai.completions.create(**args, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def token_bytes(token: str) -> bytes:
    """A logprobs token's bytes: ``bytes:\\xNN...`` read back, any other its UTF-8."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:"):].split("\\x")[1:])
    return token.encode()


def test_pieces_of_a_character_are_bytes_tokens_whose_bytes_join_to_the_text(tiny_llama):
    """Byte-level BPE splits ü, 漢 and 🙂 over several tokens: each piece is a ``bytes:``
    token with its own bytes, and all the bytes join to the text."""
    from tokenizers import Tokenizer as RawTokenizer

    from producer.gateway.answers import TokenSpeller

    raw = RawTokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    text = "Grüße 漢字 🙂 ok"
    ids = raw.encode(text, add_special_tokens=False).ids
    speller = TokenSpeller(raw)
    spelt = [speller.spell(i) for i in ids]
    assert b"".join(bytes(own) for _, _, own in spelt).decode() == text
    assert b"".join(token_bytes(token) for token, _, _ in spelt).decode() == text
    pieces = [token for token, _, _ in spelt if token.startswith("bytes:")]
    assert len(pieces) >= 9  # precondition: ü, ß, 漢, 字 and 🙂 came in pieces
    assert all(token_bytes(t) for t in pieces)
    whole = [token for token, _, _ in spelt if not token.startswith("bytes:")]
    assert "".join(whole) == "Gre   ok"  # the rest is text, offsets in characters
    assert [offset for _, offset, _ in spelt][-2:] == [10, 12]


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_a_text_chunks_event_made_from_its_shape_is_the_whole_chunks_json(url):
    """ChunkWriter.text_event (the shape made once a stream) writes what json.dumps of the
    whole chunk writes, whatever the text holds."""
    from producer.gateway.answers import ChunkWriter, TokenSpeller, sse
    from producer.wire.openai_api import parse_body

    body = {"model": MODEL, "stream": True}
    body |= ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in url
             else {"prompt": "hi"})
    writer = ChunkWriter(parse_body(url, body), "req-1", 1700000000, TokenSpeller(None))
    for text in ["plain", 'quotes " and \\ back', "line\nbreak\t", "ünïcödé 漢字 🙂", "",
                 "\ue000text\ue000", "\x00\x1f"]:
        event = writer.text_event(text)
        assert event == sse(writer.text(text, None))
        assert json.loads(event.removeprefix("data: "))["choices"][0] is not None


def test_requests_that_arrive_together_share_one_read_of_the_model_states(redis_url,
                                                                          redis_client):
    """A burst of requests while the view of the models is stale reads it once, not once
    each (a thousand streams opened at once made a thousand reads)."""
    import asyncio

    from producer.client.async_client import AsyncClient
    from producer.gateway import GatewaySettings, create_app

    def smembers_calls() -> int:
        return int(redis_client.info("commandstats").get("cmdstat_smembers", {})
                   .get("calls", 0))

    async def burst() -> list:
        async with AsyncClient(redis_url) as client:
            gateway = create_app(GatewaySettings(redis_url=redis_url), client).state.gateway
            before = smembers_calls()
            await gateway._model_states()
            one_read = smembers_calls() - before
            gateway._states_at = -1e9  # stale again
            before = smembers_calls()
            views = await asyncio.gather(*(gateway._model_states() for _ in range(200)))
            again = await gateway._model_states()  # fresh still: no read
            return [one_read, smembers_calls() - before, views, again]

    one_read, burst_reads, views, again = asyncio.run(burst())
    assert one_read >= 1 and burst_reads == one_read
    assert all(view is views[0] for view in views) and again is views[0]


def test_content_parts_names_and_null_fields_reach_the_worker_as_one_message(
        start_worker, oai, client):
    """What guidellm and clients that serialise unset fields send: answered as the same
    messages sent plainly (text parts joined by newlines, the name passed to the template)."""
    start_worker()
    plain = [{"role": "user", "content": "Where does\nthe river run?", "name": "bob"}]
    ref = client.result(client.submit(model=MODEL, messages=plain, max_tokens=6,
                                      temperature=0), timeout=60)
    chat = oai.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0,
        messages=[{"role": "user", "name": "bob", "content": [
            {"type": "text", "text": "Where does"}, {"type": "text", "text": "the river run?"}]}],
        extra_body={"metadata": None, "functions": None, "store": True, "user": "u",
                    "service_tier": "auto", "top_k": -1})
    assert chat.choices[0].message.content == ref.text
    assert chat.usage.prompt_tokens == ref.usage.prompt_tokens


def test_tokenize_detokenize_version_and_models_with_their_context(start_worker, gateway,
                                                                   client):
    from producer.version import conveyor_version

    start_worker()
    ref = client.result(client.submit(PROMPT, model=MODEL, max_tokens=1, temperature=0),
                        timeout=60)
    info = client.model_info(MODEL)
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        tokens = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
        chat_tokens = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
        bare = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT,
                                            "add_special_tokens": False}).json()
        chat = http.post(gateway.api + "/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 1}).json()
        text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})
        version = http.get("/version").json()
        models = http.get("/v1/models").json()["data"]
        embeddings = http.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
        bad = http.post("/detokenize", json={"model": MODEL, "tokens": [-1]})
        unknown = http.post("/tokenize", json={"model": "nobody", "prompt": "x"})
    assert tokens["count"] == len(tokens["tokens"]) == ref.usage.prompt_tokens
    assert chat_tokens["count"] == chat["usage"]["prompt_tokens"] > 0
    assert bare["tokens"] == tokens["tokens"][1:]  # the tokenizer's BOS left out
    assert tokens["max_model_len"] == info["max_model_len"]
    assert text.json()["prompt"] == client.tokenizer(MODEL).decode(tokens["tokens"],
                                                                   skip_special_tokens=True)
    assert version == {"version": conveyor_version()}
    assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, info["max_model_len"])]
    assert embeddings.status_code == 404 and embeddings.json()["error"]["code"] == "not_served"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert unknown.status_code == 404


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(start_worker, oai, client):
    """What guidellm asks for: each chunk's usage counts the prompt (as the gateway counted
    it, equal to the worker's count) and the tokens so far; the last one the whole."""
    start_worker()
    ref = client.result(client.submit(model=MODEL, messages=MESSAGES, max_tokens=8,
                                      temperature=0), timeout=60)
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"stream_options": {"include_usage": True,
                                       "continuous_usage_stats": True}}))
    with_choices = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_choices)
    prompt = ref.usage.prompt_tokens
    assert {c.usage.prompt_tokens for c in with_choices} == {prompt}
    so_far = [c.usage.completion_tokens for c in with_choices]
    assert so_far[0] == 0 and so_far == sorted(so_far) and so_far[-1] == 8  # role, ..., last
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens
               for c in with_choices)
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_priority_goes_on_the_request_within_the_gateways_floor(start_worker, redis_url,
                                                                  client):
    """By default no client goes ahead of requests that ask for nothing (--min-priority
    0): -5 is a 400 naming it; a gateway that allows it puts it on the request."""
    from producer.wire.protocol import FIELD, GenerationRequest

    start_worker()
    for floor in (0, -1000):
        with serve_gateway(redis_url, min_priority=floor) as gw, \
                openai.OpenAI(base_url=gw.api, api_key="unused", max_retries=0) as oai:
            ask = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
            later = oai.completions.create(**ask, extra_body={"priority": 7})
            if floor == 0:
                with pytest.raises(openai.BadRequestError) as refused:
                    oai.completions.create(**ask, extra_body={"priority": -5})
                assert refused.value.body["code"] == "priority_not_allowed"
                continue
            done = oai.completions.create(**ask, extra_body={"priority": -5})
    queued = [GenerationRequest.decode(fields[FIELD]) for _, fields in
              client.redis.xrevrange(KEYS.requests(MODEL, "interactive"), count=2)]
    assert [q.priority for q in queued] == [-5, 7]
    assert done.id.endswith(queued[0].request_id) and later.id.endswith(queued[1].request_id)


def test_text_the_tokenizer_cannot_take_is_a_400_and_the_facts_are_read_once(
        start_worker, gateway, redis_client, redis_url):
    """A lone surrogate in the JSON is a str that tokenizers refuses: a 400 naming the
    field, not a 500. And a burst of requests with no facts read yet reads them once."""
    import asyncio

    start_worker()
    for url, body in [("/v1/completions", '{"model": "%s", "prompt": "a\\ud800b"}'),
                      ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": '
                       '"user", "content": "a\\ud800b"}]}'),
                      ("/tokenize", '{"model": "%s", "prompt": "a\\ud800b"}')]:
        response = httpx.post(gateway.url + url, content=(body % MODEL).encode(), timeout=60,
                              headers={"Content-Type": "application/json"})
        assert response.status_code == 400, (url, response.text[:200])
        assert "cannot be encoded" in response.json()["error"]["message"]

    from producer.client.async_client import AsyncClient
    from producer.gateway import GatewaySettings, create_app
    from producer.gateway.model_facts import FIELDS

    def hget_calls() -> int:
        return int(redis_client.info("commandstats").get("cmdstat_hget", {}).get("calls", 0))

    async def burst() -> list:
        async with AsyncClient(redis_url) as client:
            fresh = create_app(GatewaySettings(redis_url=redis_url),
                               client).state.gateway
            before = hget_calls()
            facts = await asyncio.gather(*(fresh._facts(MODEL) for _ in range(50)))
            return [hget_calls() - before, facts]

    hgets, facts = asyncio.run(burst())
    assert hgets == len(FIELDS)  # one read: an HGET a field
    assert all(f is facts[0] for f in facts) and facts[0].tokenizer is not None


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_kept_and_special_tokens_spelt_through_the_fleet(start_worker, oai,
                                                                     client, stream):
    """vLLM's include_stop_str_in_output and skip_special_tokens, on the publisher's path
    (text made a chunk at a time), streamed or not."""
    start_worker()
    free = client.result(client.submit(PROMPT, model=MODEL, max_tokens=20, temperature=0,
                                       ignore_eos=True), timeout=60)
    stop = free.text[5:8]
    eos = min(client.model_info(MODEL)["eos_token_ids"])

    def text(**extra) -> str:
        done = oai.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                      stream=stream, **extra)
        return "".join(c.choices[0].text for c in done) if stream else done.choices[0].text

    kept = text(max_tokens=20, stop=[stop],
                extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept == free.text[: free.text.index(stop) + len(stop)]
    forced = {"max_tokens": 4, "logit_bias": {str(eos): 100}}
    spelt = text(**forced, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert text(**forced, extra_body={"ignore_eos": True}) == ""  # precondition: EOS only
    assert spelt == client.tokenizer(MODEL).decode([eos] * 4, skip_special_tokens=False) != ""
    # min_tokens: EOS, the top token under the bias, waits for three tokens.
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    done = oai.completions.create(model=MODEL, prompt=PROMPT, temperature=0, stream=stream,
                                  max_tokens=10, logit_bias={str(eos): 100},
                                  extra_body={"min_tokens": 3}, **usage)
    chunks = list(done) if stream else [done]
    assert chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=stream,
                               extra_body={"min_tokens": 3})
