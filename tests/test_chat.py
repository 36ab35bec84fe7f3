"""Chat messages end to end: the model's chat template, rendered as transformers renders it
(token for token), registered with the model, applied by the worker to ``messages`` requests;
a model without a template refuses them on the request's own stream."""

from __future__ import annotations

import json
import shutil
from datetime import datetime

import pytest
from fleet_fixtures import MODEL
from transformers import AutoTokenizer

from producer.bulk import run_batch_file
from producer.chat_template import ChatTemplate, ChatTemplateError
from producer.client.client import Client
from producer.wire.completion import FinishReason
from worker import Engine, SamplingParams
from worker.engine.tokenizer import Tokenizer

# Llama 3's shape: a header per turn, <|eot_id|> after each, BOS first; trims contents.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
# ChatML (Qwen's shape): a default system turn when the messages bring none.
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Mistral's shape: refuses a conversation whose roles do not alternate.
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}{{ '[' + message['role'] + '] ' + message['content'] }}{% endfor %}"
)
TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML}
# Qwen 3's switch: with enable_thinking false, an empty think block opens the answer.
THINKING = CHATML.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}")

CONVERSATIONS = [
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "  What colour is the sky?  "}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "Grüße, ünïcode"}],
    [{"role": "user", "content": "no system turn here"}],
]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def chat_model(request, tiny_llama, tmp_path_factory):
    """(template name, folder): the tiny model with that chat template."""
    return request.param, with_template(tiny_llama, tmp_path_factory.mktemp(request.param),
                                        TEMPLATES[request.param])


def with_template(model_dir, out, template: str | None):
    folder = out / "model"
    shutil.copytree(model_dir, folder)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    path.write_text(json.dumps(config))
    return folder


def reference_ids(model_dir, messages, **template_kwargs) -> list[int]:
    """transformers' apply_chat_template, tokenized."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                  **template_kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def our_ids(model_dir, messages) -> list[int]:
    text = ChatTemplate.from_model_dir(model_dir).render(messages)
    return Tokenizer.from_dir(model_dir).encode(text, add_special_tokens=False)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_rendered_prompts_equal_transformers_token_for_token(chat_model, messages):
    _, folder = chat_model
    assert our_ids(folder, messages) == reference_ids(folder, messages)


def test_made_models_have_a_template_transformers_renders_alike(tiny_llama):
    for messages in CONVERSATIONS:
        assert our_ids(tiny_llama, messages) == reference_ids(tiny_llama, messages)


def test_a_template_refusing_the_messages_says_why():
    template = ChatTemplate(ALTERNATING, {"bos_token": "<s>"})
    assert template.render([{"role": "user", "content": "a"}]) == "<s>[user] a"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "assistant", "content": "first"}])


def test_a_template_cannot_reach_python_internals():
    hostile = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        hostile.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # immutable: the messages cannot be changed
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_strftime_now_reads_the_clock_it_is_given():
    template = ChatTemplate("{{ strftime_now('%d %b %Y') }}",
                            now=lambda: datetime(2031, 7, 4, 12, 0))
    assert template.render([{"role": "user", "content": "x"}]) == "04 Jul 2031"


def test_chat_requests_through_a_worker_equal_the_offline_engine(chat_model, redis_url,
                                                                 start_worker, redis_client):
    name, folder = chat_model
    worker = start_worker(model_dir=folder)
    info = {k.decode(): v.decode() for k, v in redis_client.hgetall(f"conveyor:model:{MODEL}")
            .items()}
    assert info["chat_template"] == TEMPLATES[name]  # registered for producers too
    engine = Engine(folder, dtype="float64", num_kv_blocks=512)
    with Client(redis_url) as client:
        for messages in CONVERSATIONS:
            prompt = reference_ids(folder, messages)
            expected = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0]
            got = client.result(client.submit(model=MODEL, messages=messages, max_tokens=6,
                                              temperature=0), timeout=60)
            assert got.usage.prompt_tokens == len(prompt)
            assert got.token_ids == expected.token_ids and got.text == expected.text
    assert worker.status()["prompt_tokens_computed"] > 0


def test_a_model_without_a_template_refuses_messages_on_their_stream(
        tiny_llama, tmp_path, redis_url, start_worker, redis_client):
    start_worker(model_dir=with_template(tiny_llama, tmp_path, None))
    assert not redis_client.hexists(f"conveyor:model:{MODEL}", "chat_template")
    with Client(redis_url) as client:
        rid = client.submit(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        done = client.result(rid, timeout=60)
        assert done.finish_reason == FinishReason.ERROR
        assert "has no chat template" in done.error
        assert redis_client.xlen("conveyor:dead") == 1
        # The worker keeps serving prompts.
        assert client.result(client.submit("hello", model=MODEL, max_tokens=2),
                             timeout=60).finish_reason == FinishReason.LENGTH
    # Through the gateway the same refusal comes before anything is queued, streamed or not.
    import httpx
    from gateway_fixtures import serve_gateway

    with serve_gateway(redis_url) as running:
        for stream in (False, True):
            refused = httpx.post(running.api + "/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "stream": stream})
            assert refused.status_code == 400
            assert refused.json()["error"]["code"] == "no_chat_template"
    assert redis_client.xlen("conveyor:dead") == 1  # the one the worker refused above


@pytest.mark.parametrize("bad, message", [
    ([], "non-empty list, got an empty list$"),
    ({"role": "user", "content": "x"}, "non-empty list, got a dict$"),
    ([{"role": "user", "content": ["a", "b"]}], "content must be a string"),
    ([{"role": "wizard", "content": "x"}], "role must be one of"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "unsupported field"),
])
def test_malformed_messages_are_refused_before_anything_is_written(redis_url, redis_client,
                                                                   bad, message):
    with Client(redis_url) as client, pytest.raises(ValueError, match=message):
        client.submit(model=MODEL, messages=bad, allow_unregistered=True)
    assert redis_client.xlen(f"conveyor:req:{{{MODEL}}}:interactive") == 0


def test_exactly_one_of_prompt_and_messages(redis_url):
    with Client(redis_url) as client, pytest.raises(ValueError, match="exactly one"):
        client.submit("text", model=MODEL, messages=[{"role": "user", "content": "x"}],
                      allow_unregistered=True)


def test_chat_lines_of_a_batch_file_equal_the_offline_engine(chat_model, redis_url,
                                                             start_worker, tmp_path):
    _, folder = chat_model
    start_worker(model_dir=folder)
    lines = [{"custom_id": f"c{i}", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": messages, "max_completion_tokens": 5,
                       "temperature": 0}} for i, messages in enumerate(CONVERSATIONS)]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    engine = Engine(folder, dtype="float64", num_kv_blocks=512)
    with Client(redis_url) as client:
        summary = run_batch_file(client, source, out)
    assert summary.succeeded == len(lines)
    answers = {a["custom_id"]: a["response"]["body"] for a in map(json.loads,
                                                                   out.read_text().splitlines())}
    for i, messages in enumerate(CONVERSATIONS):
        prompt = reference_ids(folder, messages)
        expected = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0))[0]
        body = answers[f"c{i}"]
        assert body["object"] == "chat.completion"
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert body["choices"][0]["message"] == {"role": "assistant", "content": expected.text}


def test_chat_through_the_gateway_equals_the_offline_engine(chat_model, redis_url,
                                                            start_worker):
    import openai
    from gateway_fixtures import serve_gateway

    _, folder = chat_model
    start_worker(model_dir=folder)
    engine = Engine(folder, dtype="float64", num_kv_blocks=512)
    with serve_gateway(redis_url) as running, \
            openai.OpenAI(base_url=running.api, api_key="k", max_retries=0) as oai:
        for messages in CONVERSATIONS:
            prompt = reference_ids(folder, messages)
            expected = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0))[0]
            chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                               temperature=0)
            assert chat.usage.prompt_tokens == len(prompt)
            assert chat.choices[0].message.content == expected.text


def test_a_template_failing_any_way_fails_its_request_not_the_worker(
        tiny_llama, tmp_path, redis_url, start_worker, redis_client):
    # The sandbox refuses a huge range with OverflowError: the request's error, and the
    # worker keeps serving (it must not hand the request on to kill the next worker).
    folder = with_template(tiny_llama, tmp_path,
                           "{% for i in range(messages|length * 10**9) %}x{% endfor %}")
    with pytest.raises(ChatTemplateError, match="OverflowError"):
        ChatTemplate.from_model_dir(folder).render([{"role": "user", "content": "x"}])
    worker = start_worker(model_dir=folder)
    with Client(redis_url) as client:
        failed = client.result(client.submit(model=MODEL, messages=[
            {"role": "user", "content": "x"}] * 3), timeout=60)
        assert failed.finish_reason == FinishReason.ERROR and "OverflowError" in failed.error
        assert client.result(client.submit("fine", model=MODEL, max_tokens=2),
                             timeout=60).usage.completion_tokens == 2
    assert worker.intake.healthy and worker.state == "serving"


def test_the_template_is_found_where_transformers_finds_it(tiny_llama, tmp_path):
    folder = with_template(tiny_llama, tmp_path, CHATML)
    (folder / "chat_template.jinja").write_text("{{ bos_token }}[{{ messages[0]['content'] }}]")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": config.pop("bos_token")}))  # an older checkpoint's layout
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "hi"}]
    assert our_ids(folder, messages) == reference_ids(folder, messages)
    assert ChatTemplate.from_model_dir(folder).render(messages).startswith("<|begin_of_text|>[hi]")


def test_named_templates_without_a_default_are_refused_and_developer_is_system():
    with pytest.raises(ValueError, match="none is 'default'"):
        ChatTemplate.from_tokenizer_config({"chat_template": [{"name": "tool_use",
                                                               "template": "x"}]})
    template = ChatTemplate("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }} "
                            "{% endfor %}")
    assert template.render([{"role": "developer", "content": "a"},
                            {"role": "user", "content": "b"}]) == "system:a user:b "


def test_chat_template_kwargs_reach_the_template_through_the_gateway(
        tiny_llama, tmp_path, redis_url, start_worker):
    """vLLM's chat_template_kwargs: the worker renders with them as transformers does, and
    the gateway counts the prompt with them too."""
    import httpx
    import openai
    from gateway_fixtures import serve_gateway

    folder = with_template(tiny_llama, tmp_path, THINKING)
    messages = CONVERSATIONS[2]
    off = reference_ids(folder, messages, enable_thinking=False)
    assert len(off) > len(reference_ids(folder, messages))  # precondition: it changes them
    start_worker(model_dir=folder)
    expected = Engine(folder, dtype="float64", num_kv_blocks=512).generate(
        [off], SamplingParams(max_tokens=5, temperature=0))[0]
    with serve_gateway(redis_url) as running, \
            openai.OpenAI(base_url=running.api, api_key="k", max_retries=0) as oai:
        chat = oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        refused = httpx.post(running.api + "/chat/completions", timeout=60, json={
            "model": MODEL, "messages": messages, "chat_template_kwargs": {"bos_token": "x"}})
    assert chat.usage.prompt_tokens == len(off)
    assert chat.choices[0].message.content == expected.text
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template_kwargs"
