"""Tools at the edge and in the formats: OpenAI's tools, tool_choice and tool-call history
checked; the made models' tools templates rendered as transformers renders them; calls read
from whole answers and from streamed ones alike; forced calls' grammars."""

from __future__ import annotations

import json
import random

import pytest
from llguidance import LLMatcher
from tokenizers import Tokenizer

from producer.chat_template import ChatTemplate
from producer.wire.messages import validate_messages
from producer.wire.openai_api import ApiError, choice_body, parse_body
from producer.wire.response_format import canonical
from producer.wire.tools.formats import FORMATS, ParsedAnswer, call_deltas, format_of_template
from producer.wire.tools.spec import ToolChoice, validate_tool_choice, validate_tools
from producer.wire.tools.stream import ToolCallStream
from worker.modelgen.chat_templates import TEMPLATES
from worker.modelgen.tokenizer_files import read_shipped_tokenizer
from worker.sampling.grammar import Grammars

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    {"role": "assistant", "content": "It is 18C."},
    {"role": "user", "content": "And now?"},
]


def test_tools_are_checked_and_kept_in_one_form():
    assert validate_tools(None) is None and validate_tools([]) is None
    assert validate_tools(TOOLS) == TOOLS
    for bad, words in [
            ({"type": "function"}, "must be a list"),
            ([{"type": "retrieval"}], "function tools only"),
            ([{"type": "function", "function": {"name": "a b"}}], "letters, digits"),
            ([TOOLS[1], TOOLS[1]], "given twice"),
            ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
             "JSON Schema of an object"),
            ([{"type": "function", "function": {"name": "f", "extra": 1}}], "unknown field"),
            ([{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"description": "x" * 70_000}}}}}],
             "more than 65536"),
            ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)],
             "at most 128")]:
        with pytest.raises(ValueError, match=words):
            validate_tools(bad)


def test_tool_choice_defaults_and_names():
    tools = validate_tools(TOOLS)
    assert validate_tool_choice(None, tools) == ToolChoice("auto")
    assert validate_tool_choice(None, None) == ToolChoice("none")
    assert validate_tool_choice("required", tools).forced
    named = validate_tool_choice({"type": "function", "function": {"name": "now"}}, tools)
    assert named == ToolChoice("named", "now") and named.forced
    for bad, words in [("sometimes", "must be one of"), ("required", "needs tools"),
                       ({"type": "function", "function": {"name": "later"}}, "not one of"),
                       ({"function": {"name": "now"}}, "must be none")]:
        with pytest.raises(ValueError, match=words):
            validate_tool_choice(bad, tools if bad != "required" else None)


def test_the_tool_call_history_is_checked_and_its_arguments_parsed():
    kept = validate_messages(HISTORY)
    assert kept[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert kept[3] == {"role": "tool", "content": "18C", "tool_call_id": "c1"}
    for bad, words in [
            ({"role": "tool", "content": "x"}, "tool_call_id"),
            ({"role": "user", "content": "x", "tool_calls": []}, "unsupported field"),
            ({"role": "assistant", "content": None}, "content must be a string"),
            ({"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                "arguments": "[1]"}}]},
             "JSON object"),
            ({"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                "arguments": "{"}}]},
             "JSON object's text"),
            ({"role": "assistant", "tool_calls": [{"function": {
                "name": "f", "arguments": "[" * 100_000}}]}, "JSON object's text"),
            ({"role": "assistant", "tool_calls": [{"function": {
                "name": "f", "arguments": {"a": json.loads("[" * 40 + "]" * 40)}}}]},
             "nest deeper"),
            ({"role": "assistant", "tool_calls": [{"function": {"name": 'f"',
                                                                "arguments": {}}}]},
             "letters, digits"),
            ({"role": "assistant", "tool_calls": [{"function": {
                "name": "f", "arguments": {"a": "x" * 1_000_001}}}]}, "in all")]:
        with pytest.raises(ValueError, match=words):
            validate_messages([bad])


def test_the_api_reads_tool_fields_only_for_chat():
    api = parse_body("/v1/chat/completions", {
        "model": "m", "messages": HISTORY, "tools": TOOLS, "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "now"}}})
    assert api.tools == TOOLS and api.tool_choice == ToolChoice("named", "now")
    assert api.parallel_tool_calls is False and api.reads_calls is None  # (no format yet)
    with pytest.raises(ApiError) as refused:
        parse_body("/v1/completions", {"model": "m", "prompt": "x", "tools": TOOLS})
    assert refused.value.param == "tools"
    # (a completion may send them as "none", as clients that always send them do)
    neutral = parse_body("/v1/completions", {"model": "m", "prompt": "x", "tools": [],
                                             "tool_choice": "none",
                                             "parallel_tool_calls": True})
    assert neutral.tools is None and neutral.reads_calls is None
    with pytest.raises(ApiError) as refused:
        parse_body("/v1/chat/completions", {"model": "m", "messages": HISTORY,
                                            "tools": TOOLS, "parallel_tool_calls": "no"})
    assert refused.value.param == "parallel_tool_calls"


@pytest.mark.parametrize("style", ["qwen", "llama3", "plain"])
def test_made_templates_render_tools_as_transformers_does(style, model_factory):
    """The made model's template through conveyor's renderer and transformers'
    apply_chat_template(tools=...): the same text, history and all."""
    transformers = pytest.importorskip("transformers")
    folder = model_factory(f"tools-{style}", preset="tiny", arch="llama", chat_template=style)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    messages = validate_messages(HISTORY if style != "plain" else HISTORY[:2])
    tools = validate_tools(TOOLS) if style != "plain" else None
    ours = ChatTemplate.from_model_dir(folder).render(messages, tools=tools)
    theirs = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=True)
    assert ours == theirs
    fmt = format_of_template(TEMPLATES[style])
    assert (fmt.name if fmt else None) == {"qwen": "hermes", "llama3": "llama3_json",
                                           "plain": None}[style]
    if tools:
        assert "get_weather" in ours and "Paris" in ours and "18C" in ours


ANSWERS = {
    "hermes": [
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        "No call here, just < and <tool text.",
        '<tool_call>\nnot json\n</tool_call> and after',
        '<tool_call>\n{"name": "now", "arguments": {}}',  # the closing tag never came
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_tag|>{"name": "now", "parameters": {}}; {"name": "now", "parameters": {}}',
        "Plain words {not a call}",
        '{"name": "now", "parameters": [1]}',
        '  {"name": "Alice", "age": 30}\n',  # an answer's JSON, named: no call
    ],
}
HERMES_CALL = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
ANSWERS["hermes"] += [
    f"<tool_call>not json</tool_call> then {HERMES_CALL}",  # no call after a broken block
    f"pre {HERMES_CALL} mid {HERMES_CALL} post\n",
    f"  lead {HERMES_CALL}",
    f"\n{HERMES_CALL}\n{HERMES_CALL}\n",
    "Hello\n\n",
    HERMES_CALL[:20] + "z" * 3000 + HERMES_CALL[20:],
    # Arguments sent as they come: strings holding braces, blanks and the marker's start.
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a} </tool_ca} \\"}", '
    '"n": {"m": [1, {}]}}  }\n</tool_call>',
    '<tool_call>{"arguments": {"x": 1}, "name": "now"}</tool_call>',  # not name first
    '<tool_call>\n{"name": "now", "arguments": {"x": 1}}',  # cut before its marker
]
# Answers cut by max_tokens, broken JSON, a marker inside a string: each read as below,
# streamed or whole (test_cut_and_broken_calls_read_as_openai_reads_them).
CUT_AND_BROKEN = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     None, [("get_weather", '{"city": "Par')]),
    ('<tool_call>\n{"name":"now","arguments":{}}\n</', None, [("now", "{}")]),
    (f"{HERMES_CALL}\n<tool_", None, [("now", "{}")]),
    (f"{HERMES_CALL}\n<tool_call>\n{{\"na", None, [("now", "{}")]),
    ('<tool_call>\n{"name":"now","arguments":{"a":1},"id":"x1"}\n</tool_call>', None,
     [("now", '{"a":1}')]),
    ('<tool_call>\n{"name": "now", "arguments": {"a": 1 oops\n</tool_call> after', "after",
     [("now", '{"a": 1 oops\n')]),
    ('<tool_call>\n{"name":"now","arguments":{"html":"<b>x</b></tool_call>\\"}"}}\n'
     '</tool_call>', None, [("now", '{"html":"<b>x</b></tool_call>\\"}"}')]),
    ('Hi <tool_call>\n{"na', "Hi ", []),
    ('<tool_call>\n{"name":"get_', None, []),
    ("Hi <tool_", "Hi <tool_", []),
    ('<tool_call>\n{"arguments": {}, "name": "now"}', None, [("now", "{}")]),
    ('<tool_call>\n{"arguments": {}, "nam', '<tool_call>\n{"arguments": {}, "nam', []),
    ("<tool_call>\n[1, 2]", "<tool_call>\n[1, 2]", []),
    # A stray quote opens a string that never ends: the raw newline in it shows its JSON
    # broken, and the block's marker ends it (the next call is read, not swallowed).
    ('<tool_call>\n{"name": "size", "arguments": {"q": "a 5" screen"}}\n</tool_call>\n'
     f'{HERMES_CALL}\nDone.', "Done.", [("size", '{"q": "a 5" screen"}}\n'), ("now", "{}")]),
    # A name no tool could have (a JSON escape in it may be a lone surrogate): no call.
    ('<tool_call>{"arguments": {}, "name": "x\\udc00"}</tool_call>',
     '<tool_call>{"arguments": {}, "name": "x\\udc00"}</tool_call>', []),
    ('<tool_call>{"arguments": {"a": "\\udc00é"}, "name": "x"}</tool_call>', None,
     [("x", '{"a":"\\udc00\\u00e9"}')]),
    ('Sure. <tool_call>\n{"name":"get_', "Sure. ", []),
]
ANSWERS["hermes"] += [text for text, _, _ in CUT_AND_BROKEN]


def joined(deltas: list[dict]) -> list[dict]:
    """Stream deltas joined by index, as a client joins them."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
        assert ("name" in d) == (call["name"] == "")  # a name once, on the first
        call["name"] += d.get("name", "")
        call["arguments"] += d["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [calls[k] for k in sorted(calls)]


@pytest.mark.parametrize("fmt", sorted(ANSWERS))
def test_a_streamed_answer_reads_as_the_whole_one(fmt):
    """At every split into two deltas, at one character a delta and at random splits: the
    calls and the content are the whole answer's."""
    rng = random.Random(0)
    reader_format = FORMATS[fmt]
    for text in ANSWERS[fmt]:
        whole = reader_format.parse(text)
        every = range(len(text) + 1)
        for cuts in [*([k] for k in every), list(every),
                     *(sorted(rng.sample(every, min(len(text), 30))) for _ in range(50))]:
            stream, content, calls = ToolCallStream(reader_format), [], []
            for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
                got = stream.feed(text[a:b])
                content.append(got.content or "")
                calls += got.calls
            got = stream.finish()
            content.append(got.content or "")
            calls += got.calls
            assert joined(calls) == whole.calls, (text, cuts)
            assert ("".join(content) or None) == whole.content, (text, cuts)


def test_a_long_call_streams_its_arguments_as_they_come():
    """A call that opens with its name sends its arguments delta by delta (less what may be
    its end), and its text is joined once, when its closing marker arrives: thousands of
    deltas are not searched again each time (the answer would cost the square of its
    length)."""
    stream = ToolCallStream(FORMATS["hermes"])
    assert stream.feed('<tool_call>\n{"name": "now", "arguments": {"s": "').calls == [
        {"index": 0, "name": "now", "arguments": ""}, {"index": 0, "arguments": '{"s": "'}]
    for _ in range(20_000):
        assert stream.feed("abcd").calls == [{"index": 0, "arguments": "abcd"}]
    # The arguments' object ends at its own closing brace (read as JSON); the call's brace
    # and the closing marker after it are no part of them.
    assert stream.feed('"}').calls == [{"index": 0, "arguments": '"}'}]
    assert stream.feed('}\n</tool_call>').calls == []
    assert stream.finish() == ParsedAnswer(None, [])


@pytest.mark.parametrize("text, content, calls", CUT_AND_BROKEN)
def test_cut_and_broken_calls_read_as_openai_reads_them(text, content, calls):
    """A call cut inside its arguments is a call, its arguments cut (finish ``length``, as
    OpenAI's); a call's head cut off is dropped, as is a marker's prefix after calls; what
    follows a call's arguments in its block is not theirs; a closing marker in a string is
    text; broken JSON ends at the block's marker. (Streamed alike: ANSWERS holds these.)"""
    whole = FORMATS["hermes"].parse(text)
    assert (whole.content, [(c["name"], c["arguments"]) for c in whole.calls]) == (
        content, calls)
    body = choice_body(True, text, "length", tools=FORMATS["hermes"], call_seed="r.0")
    assert body["finish_reason"] == "length"
    assert len(body["message"].get("tool_calls", [])) == len(calls)
    assert body["message"]["content"] == (content if calls else content or "")
    json.dumps(body, ensure_ascii=False).encode()  # (no lone surrogate to send)


def test_deep_arguments_are_no_call_rather_than_an_error():
    """Nested past what the JSON encoder goes: not a call (the answer is content), never a
    RecursionError out of the reader."""
    for depth in range(960, 1010, 5):
        text = '{"name": "f", "parameters": {"a": ' + "[" * depth + "]" * depth + "}}"
        for fmt in FORMATS.values():
            fmt.parse(text)
            fmt.parse(f"<tool_call>{text}</tool_call>")


def test_parsed_calls_and_the_choice_they_make():
    whole = FORMATS["hermes"].parse(ANSWERS["hermes"][0])
    assert whole.content == "Let me look."
    # (the arguments as the model wrote them)
    assert whole.calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                           {"name": "now", "arguments": "{}"}]
    body = choice_body(True, ANSWERS["hermes"][0], "stop", tools=FORMATS["hermes"],
                       call_seed="r.0")
    assert body["finish_reason"] == "tool_calls"
    ids = [c["id"] for c in body["message"]["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert choice_body(True, ANSWERS["hermes"][0], "stop", tools=FORMATS["hermes"],
                       call_seed="r.0") == body  # the same ids for the same request
    plain = choice_body(True, "No call", "stop", tools=FORMATS["hermes"], call_seed="r.0")
    assert plain["message"] == {"role": "assistant", "content": "No call"}
    assert plain["finish_reason"] == "stop"
    deltas = call_deltas([{"index": 0, "name": "now", "arguments": ""},
                          {"index": 0, "arguments": "{}"}], "r.0")
    assert deltas == [[{"index": 0, "id": ids[0], "type": "function",
                        "function": {"name": "now", "arguments": ""}}],
                      [{"index": 0, "function": {"arguments": "{}"}}]]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_call_grammars_compile_and_accept_a_call(fmt, parallel):
    """The grammar of a required call (a $ref in a schema resolves in its own document)
    compiles, and accepts the text of a call the format's parser reads."""
    tools = validate_tools([*TOOLS, {"type": "function", "function": {
        "name": "pick", "parameters": {"type": "object", "properties": {
            "c": {"$ref": "#/$defs/colour"}}, "required": ["c"],
            "$defs": {"colour": {"enum": ["red", "blue"]}}}}}])
    grammar = FORMATS[fmt].grammar(tools, ToolChoice("required"), parallel)
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar)) == ""
    named = FORMATS[fmt].grammar(tools, ToolChoice("named", "pick"), parallel)
    assert '"name\\":\\"pick' in named and "get_weather" not in named
    if fmt == "hermes":  # (a named function once, parallel or not: no second call)
        assert "call (" not in named and ("call (" in grammar) == parallel
    key = FORMATS[fmt].arguments_key
    call = json.dumps({"name": "pick", key: {"c": "blue"}}, separators=(",", ":"))
    text = f"<tool_call>\n{call}\n</tool_call>" if fmt == "hermes" else call
    assert FORMATS[fmt].parse(text).calls == [{"name": "pick", "arguments": '{"c":"blue"}'}]
    # The grammar, compiled for a shipped tokenizer as a worker compiles it, takes the
    # call's tokens and is complete after them; a call of another colour it refuses.
    grammars = Grammars(read_shipped_tokenizer(1024).decode(), 1024, [1])
    tokenizer = Tokenizer.from_str(read_shipped_tokenizer(1024).decode())
    form = canonical({"type": "grammar", "grammar": grammar})
    matcher = grammars.matcher(form, tokenizer.encode(text, add_special_tokens=False).ids)
    assert matcher.is_accepting()
    with pytest.raises(ValueError, match="leave its response_format"):
        grammars.matcher(form, tokenizer.encode(text.replace("blue", "green"),
                                                add_special_tokens=False).ids)
