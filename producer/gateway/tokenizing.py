"""The gateway's /tokenize and /detokenize: through the model's registered tokenizer (the
one its workers encode and decode with), without asking a worker."""

from __future__ import annotations

from typing import Any

from producer.wire.openai_api import ApiError


def tokenized(tokenizer: Any, body: dict[str, Any], max_model_len: int | None
               ) -> dict[str, Any]:
    """/tokenize's answer (vLLM's shape): the prompt's ids as the model's worker encodes a
    text prompt."""
    prompt, special = body["prompt"], body.get("add_special_tokens", True)
    if not isinstance(prompt, str):
        raise ApiError("prompt must be a string (chat messages are not tokenized here yet)",
                       param="prompt")
    if not isinstance(special, bool):
        raise ApiError("add_special_tokens must be true or false", param="add_special_tokens")
    ids = tokenizer.encode(prompt, add_special_tokens=special).ids
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}


def detokenized(tokenizer: Any, body: dict[str, Any], max_model_len: int | None
                 ) -> dict[str, Any]:
    """/detokenize's answer (vLLM's shape): the ids' text, special tokens left out."""
    ids = body["tokens"]
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          and 0 <= t < tokenizer.get_vocab_size()
                                          for t in ids)):
        raise ApiError("tokens must be a list of the model's token ids", param="tokens")
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=True)}
