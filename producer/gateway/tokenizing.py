"""The gateway's /tokenize and /detokenize: through the model's registered tokenizer and
chat template (the ones its workers encode, render and decode with), without asking a
worker."""

from __future__ import annotations

import asyncio
from typing import Any

from producer.gateway.model_facts import ModelFacts
from producer.wire.openai_api import CHAT_URL, COMPLETIONS_URL, ApiError, parse_body

# Token ids decoded on the event loop; more go to a thread.
INLINE_IDS = 4096


async def tokenized(facts: ModelFacts, body: dict[str, Any]) -> dict[str, Any]:
    """/tokenize's answer (vLLM's shape): the ids a worker reads for ``prompt`` (text, with
    the tokenizer's special tokens unless ``add_special_tokens`` is false) or for
    ``messages`` (rendered by the chat template with ``chat_template_kwargs`` and
    ``tools``, with the generation prompt unless ``add_generation_prompt`` is false)."""
    chat = "messages" in body
    flag = "add_generation_prompt" if chat else "add_special_tokens"
    on = True if body.get(flag) is None else body[flag]
    if not isinstance(on, bool):
        raise ApiError(f"{flag} must be true or false", param=flag)
    fields = (("model", "messages", "chat_template_kwargs", "tools") if chat
              else ("model", "prompt"))
    api = parse_body(CHAT_URL if chat else COMPLETIONS_URL,
                     {k: body[k] for k in fields if k in body})
    ids = await facts.prompt_ids(api, **{flag: on})
    if ids is None:  # (the tokenizer is there: a chat template is not)
        raise ApiError(f"model {api.model!r} registered no chat template",
                       param="messages", code="no_chat_template")
    return {"count": len(ids), "max_model_len": facts.max_model_len, "tokens": ids}


async def detokenized(facts: ModelFacts, body: dict[str, Any]) -> dict[str, Any]:
    """/detokenize's answer (vLLM's shape): the ids' text, special tokens left out."""
    ids, tokenizer = body["tokens"], facts.tokenizer
    vocab = tokenizer.get_vocab_size()
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          and 0 <= t < vocab for t in ids)):
        raise ApiError("tokens must be a list of the model's token ids", param="tokens")
    if len(ids) > INLINE_IDS:
        return {"prompt": await asyncio.to_thread(tokenizer.decode, ids,
                                                  skip_special_tokens=True)}
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=True)}
