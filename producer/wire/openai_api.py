"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) read into conveyor
requests, for the gateway and for batch files alike.

A field set to null is absent (clients serialise unset fields so). Every other field is
implemented (completions' ``echo``: the prompt first, with its logprobs where asked, which
``params.prompt_logprobs`` makes in the prefill; chat's ``tools``, ``tool_choice`` and
``parallel_tool_calls``: producer/wire/tools/), accepted only at the value that means
"nothing special" (``best_of: 1``, chat's ``echo: false``, ...), accepted and ignored because it
changes nothing in the answer (IGNORED: ``user``, ``store``, ``metadata``, ...), or refused
with an error naming it: a client that asks for what it would not get must hear so.
conveyor's own sampling fields (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``) are accepted as extensions, as vLLM accepts them (``top_k: -1``, vLLM's
"off", is conveyor's 0). Chat content may be a list of text parts (joined by newlines, as
vLLM does); an image, audio or file part is refused, named.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from producer.wire.messages import validate_messages, validate_template_kwargs
from producer.wire.params import SamplingParams
from producer.wire.protocol import PRIORITY_RANGE
from producer.wire.tools.formats import ToolFormat, ended_with_calls, openai_calls
from producer.wire.tools.spec import ToolChoice, validate_tool_choice, validate_tools

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"

# Body fields that are SamplingParams fields of the same name and meaning.
SAMPLING_FIELDS = frozenset({"max_tokens", "temperature", "top_p", "seed", "stop",
                             "presence_penalty", "frequency_penalty", "logit_bias",
                             # conveyor's extensions
                             "top_k", "min_p", "repetition_penalty", "ignore_eos",
                             "stop_token_ids",
                             # vLLM's
                             "skip_special_tokens", "include_stop_str_in_output",
                             "min_tokens",
                             # OpenAI's choices: each served as a request (params.n)
                             "n",
                             # structured outputs (producer/wire/response_format.py)
                             "response_format"})
# Fields accepted only at the value that asks for nothing special.
NEUTRAL = {"best_of": 1, "echo": False, "suffix": None}
# Fields that change nothing in the answer: the caller's end-user ids, OpenAI's storage,
# tags and billing tier, its prompt cache's routing key.
IGNORED = frozenset({"user", "safety_identifier", "store", "metadata", "service_tier",
                     "prompt_cache_key"})
# Chat's tool fields (producer/wire/tools/spec.py).
TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
# Chat content parts: text is read; these are named in a refusal (no model input for them).
TEXT_PART = "text"
# stream_options' fields: OpenAI's include_usage, vLLM's continuous_usage_stats.
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
# OpenAI's limit on completions' integer ``logprobs``; chat's ``top_logprobs`` goes to 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20


class ApiError(ValueError):
    """A request the API refuses, shaped as OpenAI's error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # Of a request that was submitted (and failed): its answer names it.
        self.request_id = request_id
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass
class ApiRequest:
    """One body, read: what to submit and how to answer."""

    chat: bool
    model: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    # stream_options.include_usage: a last chunk with the usage and no choices.
    include_usage: bool = False
    # stream_options.continuous_usage_stats (vLLM's): the usage so far on every chunk.
    continuous_usage: bool = False
    # The answer carries logprobs (chat: ``logprobs: true``; completions: ``logprobs: k``).
    logprobs: bool = False
    # vLLM's priority: the request's (lower is more urgent, as vLLM's), 0 unless given.
    priority: int = 0
    # vLLM's chat_template_kwargs: more variables for the chat template (chat only).
    chat_template_kwargs: dict[str, Any] | None = None
    # Chat's functions for the model, what it may do with them, and whether it may call
    # several at once.
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel_tool_calls: bool = True
    # The model's tool-call format (the gateway sets it from the chat template; None: the
    # answer is read as text).
    tool_format: ToolFormat | None = None
    @property
    def reads_calls(self) -> ToolFormat | None:
        """The format its answer's calls are read in (None: the answer is text)."""
        return self.tool_format if self.tool_choice.mode != "none" else None

    @property
    def n(self) -> int:
        """Choices asked for (OpenAI's ``n``)."""
        return self.sampling.get("n", 1)

    # Completions' echo: the answer's text starts with the prompt (and its logprobs, where
    # asked, with the prompt's tokens first: params.prompt_logprobs).
    echo: bool = False


def parse_body(url: str, body: Any, model: str | None = None) -> ApiRequest:
    """The body of a POST to ``url``; ``model`` (when given) serves a body without one.
    ApiError (400) names the first field that cannot be honoured."""
    if url not in (COMPLETIONS_URL, CHAT_URL):
        raise ApiError(f"unsupported url {url!r}: {COMPLETIONS_URL} or {CHAT_URL}",
                       status=404, code="unknown_url")
    if not isinstance(body, Mapping):
        raise ApiError("the request body must be a JSON object")
    body = {name: value for name, value in body.items() if value is not None}
    if body.get("top_k") == -1:  # vLLM's "off"
        del body["top_k"]
    chat = url == CHAT_URL
    if not chat:  # (tools are chat's; a completion may send them only as "none")
        for name in TOOL_FIELDS & set(body):
            if name != "parallel_tool_calls" and body[name] not in ([], "none"):
                raise ApiError(f"{name} is for chat completions ({CHAT_URL}) only",
                               param=name, code="unsupported_parameter")
        body = {k: v for k, v in body.items() if k not in TOOL_FIELDS}
    known = SAMPLING_FIELDS | IGNORED | set(NEUTRAL) | {"model", "stream", "stream_options",
                                                        "priority"}
    known |= ({"messages", "max_completion_tokens", "logprobs", "top_logprobs",
               "chat_template_kwargs", *TOOL_FIELDS} if chat else {"prompt", "logprobs"})
    for name, value in body.items():
        if name not in known:
            raise ApiError(f"{name!r} is not supported by conveyor", param=name,
                           code="unsupported_parameter")
        if name == "echo" and not chat:
            continue  # completions' echo is served (_completion_fields)
        if name in NEUTRAL and value not in (NEUTRAL[name], None, []):  # [] tools: none
            raise ApiError(f"{name}={_short(value)} is not supported by conveyor (only "
                           f"{_short(NEUTRAL[name])})", param=name, code="unsupported_value")
    name = body.get("model", model)
    if not isinstance(name, str) or not name:
        raise ApiError("'model' is required: a model name (GET /v1/models lists them)",
                       param="model")
    req = ApiRequest(chat=chat, model=name)
    req.stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not req.stream:
            raise ApiError("stream_options is only allowed with stream: true",
                           param="stream_options")
        if not isinstance(options, Mapping) or set(options) - STREAM_OPTIONS:
            raise ApiError("stream_options supports include_usage and continuous_usage_stats "
                           "only", param="stream_options", code="unsupported_parameter")
        req.include_usage = _bool(options, "include_usage")
        req.continuous_usage = _bool(options, "continuous_usage_stats")
    req.sampling = {k: v for k, v in body.items() if k in SAMPLING_FIELDS and v is not None}
    priority = body.get("priority", 0)
    if not _int(priority) or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise ApiError(f"priority must be an integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}] "
                       "(lower is more urgent)", param="priority")
    req.priority = priority
    if chat:
        _chat_fields(body, req)
    else:
        _completion_fields(body, req)
    try:
        SamplingParams.from_dict(req.sampling)
    except ValueError as exc:
        raise ApiError(str(exc), param=param_of(str(exc))) from None
    return req


def _chat_fields(body: Mapping[str, Any], req: ApiRequest) -> None:
    messages = body.get("messages")
    if isinstance(messages, list):
        messages = [_with_text_content(i, m) for i, m in enumerate(messages)]
    try:
        req.messages = validate_messages(messages)
    except ValueError as exc:
        raise ApiError(str(exc), param="messages") from None
    if "chat_template_kwargs" in body:
        try:
            req.chat_template_kwargs = validate_template_kwargs(body["chat_template_kwargs"])
        except ValueError as exc:
            raise ApiError(str(exc), param="chat_template_kwargs") from None
    limit = body.get("max_completion_tokens")
    if limit is not None:
        if body.get("max_tokens") is not None and body["max_tokens"] != limit:
            raise ApiError("max_tokens and max_completion_tokens disagree",
                           param="max_completion_tokens")
        req.sampling["max_tokens"] = limit
    if _bool(body, "logprobs"):
        top = body.get("top_logprobs")
        top = 0 if top is None else top
        if not _int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ApiError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                           param="top_logprobs")
        req.sampling["logprobs"] = top
        req.logprobs = True
    elif body.get("top_logprobs") is not None:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    try:
        req.tools = validate_tools(body.get("tools"))
    except ValueError as exc:
        raise ApiError(str(exc), param="tools") from None
    try:
        req.tool_choice = validate_tool_choice(body.get("tool_choice"), req.tools)
    except ValueError as exc:
        raise ApiError(str(exc), param="tool_choice") from None
    req.parallel_tool_calls = "parallel_tool_calls" not in body or _bool(body,
                                                                       "parallel_tool_calls")


def _with_text_content(i: int, message: Any) -> Any:
    """A message without its null fields, a content given as a list of parts as one string
    (its text parts joined by newlines, as vLLM does); ApiError naming a part that is not
    text."""
    if not isinstance(message, Mapping):
        return message
    message = {name: value for name, value in message.items() if value is not None}
    if not isinstance(message.get("content"), list):
        return message
    texts = []
    for j, part in enumerate(message["content"]):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != TEXT_PART:
            raise ApiError(f"messages[{i}].content[{j}]: {_short(kind)} parts are not "
                           "supported by conveyor (text parts only: no image, audio or file "
                           "input)", param="messages", code="unsupported_value")
        if not isinstance(part.get("text"), str):
            raise ApiError(f"messages[{i}].content[{j}].text must be a string",
                           param="messages")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def _completion_fields(body: Mapping[str, Any], req: ApiRequest) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a list, as text or as token ids
    tokens = (isinstance(prompt, list) and prompt
              and all(_int(t) and t >= 0 for t in prompt))
    if not (isinstance(prompt, str) and prompt) and not tokens:
        raise ApiError("prompt must be a non-empty string or list of token ids (several "
                       "prompts in one request are not supported: send one each)",
                       param="prompt")
    req.prompt = prompt
    k = body.get("logprobs")
    if k is not None:
        if not _int(k) or not 0 <= k <= MAX_COMPLETION_LOGPROBS:
            raise ApiError(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]",
                           param="logprobs")
        req.sampling["logprobs"] = k
        req.logprobs = True
    req.echo = _bool(body, "echo")
    if req.echo and req.logprobs:
        req.sampling["prompt_logprobs"] = k


def choice_body(chat: bool, text: str, finish_reason: str,
                logprobs: dict[str, Any] | None = None, tools: ToolFormat | None = None,
                call_seed: str = "") -> dict[str, Any]:
    """The one choice of a whole answer: a chat ``message``, or a completion's ``text``
    (the gateway's answers and batch files' output lines alike). ``tools``: the text is
    read for calls in that format (their ids made from ``call_seed``); an answer that
    made calls finished with ``tool_calls``."""
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        parsed = tools.parse(text) if tools is not None else None
        if parsed is not None and parsed.calls:
            message = {"role": "assistant", "content": parsed.content,
                       "tool_calls": openai_calls(parsed.calls, call_seed)}
            finish_reason = ended_with_calls(finish_reason)
        elif parsed is not None:  # (the content a stream of it sends: a call cut off in its
            message["content"] = parsed.content or ""  # head is none of it)
        return {"index": 0, "message": message, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false", param=name)
    return value


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# Wire names a refusal may give, as the OpenAI API's fields: a prompt of token ids is sent
# on the wire as prompt_token_ids, and the prompt's log-probabilities are asked by echo.
_API_NAMES = {"prompt_token_ids": "prompt", "prompt": "prompt", "messages": "messages",
              "logprobs": "logprobs", "prompt_logprobs": "echo"}
# Quoted text in a message (a model's name, a value sent) is the client's, not a field.
_QUOTED = re.compile(r"(?<![A-Za-z])'[^']*'|\"[^\"]*\"")


def param_of(message: str, chat: bool = False) -> str | None:
    """The field a refusal's message names: its first word outside quotes that is an API
    field (``each stop string ...``, ``at most 64 stop_token_ids``, ``prompt_token_ids has
    token id ...``; a chat request's prompt is its ``messages``); None where it names none."""
    for word in re.findall(r"[a-z_]+", _QUOTED.sub(" ", message)):
        name = word if word in SAMPLING_FIELDS else _API_NAMES.get(word)
        if name is not None:
            return "messages" if chat and name == "prompt" else name
    return None
