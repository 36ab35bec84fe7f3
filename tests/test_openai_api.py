"""OpenAI request bodies read into conveyor requests (producer/wire/openai_api.py): what is
implemented, what is accepted only at its neutral value, what is refused and named."""

from __future__ import annotations

import pytest

from producer.wire.openai_api import CHAT_URL, COMPLETIONS_URL, ApiError, param_of, parse_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_chat_body_maps_onto_sampling_fields_and_logprobs():
    req = parse_body(CHAT_URL, {**CHAT, "max_completion_tokens": 5, "temperature": 0.5,
                                "top_p": 0.9, "stop": ["x"], "seed": 3, "logprobs": True,
                                "top_logprobs": 2, "presence_penalty": 0.1,
                                "logit_bias": {"7": -100}, "user": "someone"})
    assert req.chat and req.messages == CHAT["messages"] and req.logprobs
    assert req.sampling == {"max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "stop": ["x"],
                            "seed": 3, "presence_penalty": 0.1, "logit_bias": {"7": -100},
                            "logprobs": 2}


def test_neutral_values_pass_and_anything_else_is_named():
    neutral = {"n": 1, "tools": [], "tool_choice": "none", "echo": False, "best_of": 1,
               "response_format": {"type": "text"}, "stream": False}
    for name, value in neutral.items():
        parse_body(CHAT_URL if name != "echo" and name != "best_of" else COMPLETIONS_URL,
                   {**(CHAT if name not in ("echo", "best_of") else
                       {"model": "m", "prompt": "x"}), name: value})
    for body, param in [({**CHAT, "n": 17}, "n"), ({**CHAT, "functions": []}, "functions"),
                        ({**CHAT, "best_of": 2}, "best_of"), ({**CHAT, "n": 0}, "n"),
                        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
                        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
                        ({**CHAT, "max_tokens": 3, "max_completion_tokens": 4},
                         "max_completion_tokens")]:
        with pytest.raises(ApiError) as refused:
            parse_body(CHAT_URL, body)
        assert refused.value.param == param and refused.value.status == 400


def test_completion_prompts_text_ids_or_one_in_a_list():
    for prompt, expected in [("x", "x"), ([1, 2], [1, 2]), (["x"], "x"), ([[1, 2]], [1, 2])]:
        assert parse_body(COMPLETIONS_URL, {"model": "m", "prompt": prompt}).prompt == expected
    with pytest.raises(ApiError, match="several prompts"):
        parse_body(COMPLETIONS_URL, {"model": "m", "prompt": ["a", "b"]})
    with pytest.raises(ApiError) as missing:
        parse_body(COMPLETIONS_URL, {"prompt": "x"})
    assert missing.value.param == "model"


def test_null_fields_are_absent_and_fields_that_change_nothing_are_accepted():
    """Clients that serialise unset fields as null, and OpenAI's bookkeeping fields, get the
    same request as a body without them; a field that would change the answer still gets
    its 400 however it is set."""
    bare = parse_body(CHAT_URL, {**CHAT, "max_tokens": 5})
    nulls = {name: None for name in ("metadata", "store", "functions", "tools", "n", "seed",
                                     "stop", "logprobs", "top_logprobs", "stream_options",
                                     "response_format", "bogus")}
    ignored = {"user": "u", "safety_identifier": "s", "store": True, "metadata": {"k": "v"},
               "service_tier": "auto", "prompt_cache_key": "k", "parallel_tool_calls": True}
    for extra in (nulls, ignored):
        req = parse_body(CHAT_URL, {**CHAT, "max_tokens": 5, **extra})
        assert (req.messages, req.sampling, req.stream, req.logprobs) \
            == (bare.messages, bare.sampling, bare.stream, bare.logprobs)
    assert parse_body(CHAT_URL, {**CHAT, "top_k": -1}).sampling == {}  # vLLM's "off"
    with pytest.raises(ApiError) as refused:
        parse_body(CHAT_URL, {**CHAT, "functions": [{"name": "f"}]})
    assert refused.value.param == "functions"


def test_chat_content_parts_join_their_text_and_name_other_parts():
    parts = [{"type": "text", "text": "Where does"}, {"type": "text", "text": "it run?"}]
    req = parse_body(CHAT_URL, {"model": "m", "messages": [
        {"role": "system", "content": "Be brief.", "name": None},
        {"role": "user", "content": parts, "name": "bob"}]})
    assert req.messages == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Where does\nit run?", "name": "bob"}]
    for part, named in [({"type": "image_url", "image_url": {"url": "x"}}, "'image_url'"),
                        ({"type": "input_audio", "input_audio": {}}, "'input_audio'"),
                        ({"type": "file", "file": {}}, "'file'"), ({"text": "x"}, "None")]:
        with pytest.raises(ApiError) as refused:
            parse_body(CHAT_URL, {"model": "m", "messages": [
                {"role": "user", "content": [parts[0], part]}]})
        assert refused.value.param == "messages"
        assert f"messages[0].content[1]: {named} parts are not supported" \
            in refused.value.message
    with pytest.raises(ApiError, match="name must be a string"):
        parse_body(CHAT_URL, {"model": "m", "messages": [
            {"role": "user", "content": "x", "name": 7}]})


def test_priority_is_the_requests_in_conveyors_range():
    assert parse_body(CHAT_URL, CHAT).priority == 0
    assert parse_body(CHAT_URL, {**CHAT, "priority": -5}).priority == -5
    for bad in (1001, -1001, 1.5, True, "high"):
        with pytest.raises(ApiError) as refused:
            parse_body(CHAT_URL, {**CHAT, "priority": bad})
        assert refused.value.param == "priority"


def test_chat_template_kwargs_are_names_a_template_can_take():
    from producer.chat_template import ChatTemplate

    body = {**CHAT, "chat_template_kwargs": {}}
    assert parse_body(CHAT_URL, body).chat_template_kwargs is None  # nothing to send
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    for bad in ({"range": 1}, {"self": 1}, {"bos_token": "x"}, {"é": 1}, {"a-b": 1},
                {"deep": nested}, {"x": float("nan")}, {"x": "y" * 20_000}):
        with pytest.raises(ApiError) as refused:
            parse_body(CHAT_URL, {**CHAT, "chat_template_kwargs": bad})
        assert refused.value.param == "chat_template_kwargs"
    template = ChatTemplate("{{ mode }}{{ messages[0]['content'] }}{% for i in range(2) %}"
                            "{{ i }}{% endfor %}")
    assert template.render(CHAT["messages"], extra={"mode": "S"}) == "Shi01"


def test_completions_echo_asks_for_prompt_logprobs_only_with_logprobs():
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 1}
    echoed = parse_body(COMPLETIONS_URL, {**body, "echo": True, "logprobs": 1})
    assert echoed.echo and echoed.sampling["prompt_logprobs"] == 1
    plain = parse_body(COMPLETIONS_URL, {**body, "echo": True})
    assert plain.echo and "prompt_logprobs" not in plain.sampling
    assert not parse_body(COMPLETIONS_URL, {**body, "echo": False}).echo
    with pytest.raises(ApiError, match="echo must be true or false"):
        parse_body(COMPLETIONS_URL, {**body, "echo": "yes"})
    with pytest.raises(ApiError) as chat:
        parse_body(CHAT_URL, {**CHAT, "echo": True})
    assert chat.value.param == "echo"


def test_n_choices_are_a_sampling_field():
    req = parse_body(CHAT_URL, {**CHAT, "n": 3, "seed": 5})
    assert req.n == 3 and req.sampling == {"n": 3, "seed": 5}
    assert parse_body(CHAT_URL, CHAT).n == 1


def test_a_refusal_names_the_api_field_its_message_is_about():
    assert param_of("each stop string must be a non-empty string") == "stop"
    assert param_of("at most 64 stop_token_ids") == "stop_token_ids"
    assert param_of("prompt_token_ids has token id 2 outside the vocabulary") == "prompt"
    # A worker's refusals: a chat request's prompt is its messages; prompt logprobs, echo.
    too_long = "prompt of 5000 tokens leaves no room to generate: the model's max is 4096"
    assert param_of(too_long) == "prompt" and param_of(too_long, chat=True) == "messages"
    assert param_of("prompt_logprobs=5 of a prompt of 9000 tokens would not fit") == "echo"
    # Quoted text is the client's: a model named 'stop-n' is not the stop field.
    assert param_of("model 'stop-n' is not served") is None
    assert param_of("unknown sampling parameter(s): foo") is None
