"""What the gateway knows of a model from its registration: its tokenizer, chat template
and context length, read at most once a minute. With them it counts a request's prompt
tokens as the model's workers will (the same tokenizer and template, rendered and encoded
the same way: worker/fleet/intake/intake.py), so a prompt over the context is answered 400
before it is queued, streamed or not, and a stream's usage can be given on every chunk."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import structlog

from producer.chat_template import ChatTemplate
from producer.client.client import tokenizer_from
from producer.wire.openai_api import ApiError, ApiRequest
from producer.wire.params import grammar_conflict
from producer.wire.protocol import check_prompt_logprobs_size
from producer.wire.response_format import canonical
from producer.wire.tools.formats import ToolFormat, format_of_template

log = structlog.get_logger(__name__)

# Prompts longer than this (characters) are encoded off the event loop.
INLINE_PROMPT_CHARS = 20_000
# The model hash's fields read here.
FIELDS = ("tokenizer_json", "chat_template", "chat_special_tokens", "max_model_len",
          "simulated")


@dataclass(frozen=True)
class ModelFacts:
    """A registered model's tokenizer and chat template (None: it registered none) and
    context length (None: not a number)."""

    tokenizer: Any | None = None
    template: ChatTemplate | None = None
    max_model_len: int | None = None
    # The model registered no chat template (not: one this process could not read).
    no_template: bool = False
    # Simulated workers serve it (worker/engine/simulated.py): their tokens are no model's.
    simulated: bool = False

    def simulated_refusal(self, api: ApiRequest) -> ApiError | None:
        """What a simulated worker would refuse of ``api`` (worker/engine/admission.py,
        ``check_params``), as a 400 naming the field the client sent: answered before the
        request is queued, streamed or not, rather than as an event after a 200."""
        if not self.simulated:
            return None
        why = "this model is served by simulated workers (docs/simulated.md)"
        if "logprobs" in api.sampling or "prompt_logprobs" in api.sampling:
            return ApiError(f"logprobs: {why}: they compute no logits, so they cannot give "
                            "log-probabilities", param="logprobs")
        if "response_format" in api.sampling:
            field = "tool_choice" if api.tool_choice.forced else "response_format"
            return ApiError(f"{field}: {why}: their tokens are not the model's, so they "
                            "cannot follow a grammar" + (" (a forced tool call is one)"
                                                        if field == "tool_choice" else ""),
                            param=field)
        return None

    @cached_property
    def tool_format(self) -> ToolFormat | None:
        """The tool-call format the model's chat template teaches (None: it renders none)."""
        return format_of_template(self.template.source if self.template else None)

    def use_tools(self, api: ApiRequest) -> None:
        """Set ``api``'s tool-call format from the model's template and, for a forced call
        (tool_choice required or named), the grammar that writes it; ApiError (400) where
        the template renders no tools in a format conveyor reads, or the answer is already
        held to a response_format."""
        if not api.tools:
            return
        fmt = self.tool_format
        if fmt is None:
            raise ApiError(f"model {api.model!r} has no chat template that renders tools in a "
                           "tool-call format conveyor reads (Hermes/Qwen <tool_call> blocks, "
                           "Llama 3.1 JSON calls): send the request without tools",
                           param="tools", code="tools_not_supported")
        api.tool_format = fmt
        if not api.tool_choice.forced:
            return
        if "response_format" in api.sampling:
            raise ApiError("response_format cannot be given with a forced tool call "
                           "(tool_choice required or a named function): the call's grammar "
                           "holds the answer", param="response_format")
        if (name := grammar_conflict(api.sampling.get)) is not None:
            raise ApiError(f"{name} does not go with a forced tool call (tool_choice required "
                           "or a named function): its grammar ends the answer where the call "
                           "is complete", param=name)
        form = {"type": "grammar",
                "grammar": fmt.grammar(api.tools, api.tool_choice, api.parallel_tool_calls)}
        try:
            canonical(form)  # (a parameters schema the grammar compiler cannot serve)
        except ValueError as exc:
            raise ApiError(f"the tools cannot be forced: {exc}", param="tools") from None
        api.sampling["response_format"] = form

    async def prompt_tokens(self, api: ApiRequest) -> int | None:
        """How many tokens the model's workers will read for ``api``'s prompt; None where
        this cannot tell (no tokenizer, or chat without a template: the worker refuses
        such a request itself). ApiError (400) when the chat template refuses the
        messages, as the worker would."""
        if isinstance(api.prompt, list):
            return len(api.prompt)
        ids = await self.prompt_ids(api)
        return None if ids is None else len(ids)

    async def prompt_ids(self, api: ApiRequest, add_generation_prompt: bool = True,
                         add_special_tokens: bool = True) -> list[int] | None:
        """The token ids the model's workers will read for ``api``'s prompt (as
        prompt_tokens counts them); /tokenize may ask for a chat without the generation
        prompt, or a text without the tokenizer's special tokens."""
        if isinstance(api.prompt, list):
            return list(api.prompt)
        if api.messages is not None and self.no_template:
            # The worker's own refusal, before the request is queued.
            raise ApiError(f"model {api.model!r} has no chat template: send a prompt (POST "
                           "/v1/completions) instead of messages", param="messages",
                           code="no_chat_template")
        if self.tokenizer is None or (api.messages is not None and self.template is None):
            return None
        if api.messages is not None:
            try:
                # (off the event loop: a template is a checkpoint's code, however slow)
                text = await asyncio.to_thread(
                    self.template.render,  # type: ignore[union-attr]
                    api.messages, add_generation_prompt, extra=api.chat_template_kwargs,
                    tools=api.tools)
            except ValueError as exc:  # ChatTemplateError
                raise ApiError(str(exc), param="messages", code="chat_template") from None
            special = False  # the template writes them
        else:
            text, special = api.prompt, add_special_tokens
        try:
            if len(text) > INLINE_PROMPT_CHARS:
                encoded = await asyncio.to_thread(self.tokenizer.encode, text,
                                                  add_special_tokens=special)
            else:
                encoded = self.tokenizer.encode(text, add_special_tokens=special)
        except Exception as exc:  # noqa: BLE001 (tokenizers raises TypeError on a lone surrogate)
            raise ApiError(f"the prompt cannot be encoded: {str(exc)[:200]}",
                           param="messages" if api.chat else "prompt") from None
        return list(encoded.ids)

    def check_context(self, api: ApiRequest, prompt_tokens: int | None) -> None:
        """ApiError (400 context_length_exceeded) when the prompt leaves no room to
        generate: the worker's own rule (worker/engine/admission.py), decided here."""
        if (prompt_tokens is not None and self.max_model_len is not None
                and prompt_tokens >= self.max_model_len):
            raise ApiError(f"prompt of {prompt_tokens} tokens leaves no room to generate: "
                           f"the model's max length is {self.max_model_len} tokens",
                           param="messages" if api.chat else "prompt",
                           code="context_length_exceeded")
        k = api.sampling.get("prompt_logprobs")
        if prompt_tokens is not None and k is not None:
            try:
                check_prompt_logprobs_size(prompt_tokens, k)
            except ValueError as exc:
                raise ApiError(str(exc), param="echo", code="prompt_too_long_for_echo") from None


async def read_facts(redis: Any, key: str) -> ModelFacts:
    """The facts of the model registered at ``key`` (its hash), the tokenizer parsed off the
    event loop. A tokenizer or template this process cannot read (another tokenizers or
    jinja2 than the workers') is logged and left out: the workers still judge the request."""
    pipe = redis.pipeline(transaction=False)
    for name in FIELDS:  # (HGETs: the producer's ACL has no HMGET)
        pipe.hget(key, name)
    raw_tokenizer, template, special, length, simulated = await pipe.execute()
    tokenizer = None
    if raw_tokenizer is not None:
        try:
            tokenizer = await asyncio.to_thread(tokenizer_from, raw_tokenizer)
        except Exception as exc:  # noqa: BLE001 (any parse failure: counted by workers instead)
            log.warning("cannot read the model's tokenizer", key=key, error=repr(exc))
    registration = {"chat_template": _text(template), "chat_special_tokens": _text(special)}
    try:
        chat_template = ChatTemplate.from_registration(registration)
    except Exception as exc:  # noqa: BLE001 (the same)
        log.warning("cannot read the model's chat template", key=key, error=repr(exc))
        chat_template = None
    return ModelFacts(tokenizer, chat_template, registered_int(length),
                      no_template=template is None, simulated=simulated == b"1")


def registered_int(value: bytes | None) -> int | None:
    """A whole number field of the model hash (max_model_len), or None where it is not one."""
    return int(value) if (value or b"").isdigit() else None


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode()
