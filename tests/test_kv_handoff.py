"""A request's prompt computed on one engine, its KV carried through the fleet KV tier on a
real Redis, and its generation continued on another engine: float64 greedy outputs equal
one engine serving the whole request, and the second engine computes no prompt token.
Unusable transfers fall back to recomputing, still exact."""

from __future__ import annotations

import random

import pytest

from kvstore.handoff import KVHandoff
from kvstore.tier import TierCorrupt
from kvstore.tier.redis_tier import RedisKVTier
from worker import Engine, SamplingParams
from worker.fleet.handoff.engine_kv import add_with_kv, export_kv, kv_layout

SETTINGS = dict(dtype="float64", num_kv_blocks=400, block_size=16, max_num_batched_tokens=512)
FINGERPRINT = "tiny-llama-float64"


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [20, 1500, 16, 17] + [rng.randint(20, 400) for _ in range(n - 4)]
    return [[rng.randrange(2, 1000) for _ in range(length)] for length in lengths]


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=4 + i % 7, temperature=0, ignore_eos=True)


def _prefill(engine: Engine, prompt: list[int], params: SamplingParams, rid: str
             ) -> tuple[int, KVHandoff]:
    """Run ``rid`` until its first token; its KV, then drop it here."""
    engine.add_request(prompt, params, request_id=rid)
    first = None
    while first is None:
        first = next((o.new_token_ids[0] for o in engine.step()
                      if o.request_id == rid and o.new_token_ids), None)
    handoff = export_kv(engine, rid)
    engine.abort(rid)
    return first, handoff


def _run(engine: Engine) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.completion is not None:
                done[out.request_id] = out.completion
    return done


def test_decode_engine_continues_from_transferred_kv_exactly(tiny_llama, redis_client):
    prompts = _prompts(16)
    reference = Engine(tiny_llama, **SETTINGS).generate(
        prompts, [_params(i) for i in range(len(prompts))])
    prefill, decode = Engine(tiny_llama, **SETTINGS), Engine(tiny_llama, **SETTINGS)
    tier = RedisKVTier(redis_client)
    for i, prompt in enumerate(prompts):
        first, handoff = _prefill(prefill, prompt, _params(i), f"r{i}")
        assert handoff.num_tokens == len(prompt)
        tier.put(f"r{i}", kv_layout(prefill), handoff.payload,
                 -(-handoff.num_tokens // 16), handoff.num_tokens)
        header, payload = tier.get(f"r{i}", kv_layout(decode))
        # Free blocks full of NaN: only the imported KV can make the outputs right.
        decode.kv_cache.fill_blocks_(decode.block_pool.free_block_ids(), float("nan"))
        add_with_kv(decode, prompt, _params(i), KVHandoff(header.num_tokens, payload),
                    request_id=f"r{i}", generated_token_ids=[first])
    done = _run(decode)
    for i, ref in enumerate(reference):
        got = done[f"r{i}"]
        assert [*got.token_ids] == ref.token_ids, f"prompt {i} ({len(prompts[i])} tokens)"
        assert got.usage.kv_transferred_tokens == got.usage.prompt_tokens == len(prompts[i])
    # The decode engine computed only generated tokens: never a prompt token.
    assert decode.runner.num_computed_tokens == sum(len(r.token_ids) - 1 for r in reference)
    assert decode.scheduler.counters["kv_imported_tokens"] == sum(len(p) for p in prompts)
    assert decode.block_pool.num_free == decode.block_pool.num_blocks


def test_an_unusable_transfer_falls_back_to_recomputing(tiny_llama, redis_client):
    prompt, params = _prompts(5)[4], _params(3)
    reference = Engine(tiny_llama, **SETTINGS).generate([prompt], params)[0]
    prefill, decode = Engine(tiny_llama, **SETTINGS), Engine(tiny_llama, **SETTINGS)
    tier = RedisKVTier(redis_client, chunk_bytes=4096)
    first, handoff = _prefill(prefill, prompt, params, "r")
    tier.put("r", kv_layout(prefill, FINGERPRINT), handoff.payload, -(-handoff.num_tokens // 16),
             handoff.num_tokens)
    chunk = tier.chunk_key("r", 1)
    redis_client.set(chunk, redis_client.get(chunk)[:100])  # truncated in the tier
    with pytest.raises(TierCorrupt):
        tier.get("r", kv_layout(decode, FINGERPRINT))
    # What a decode worker does then: the resumption path, computing the prompt.
    decode.add_request(prompt, params, request_id="r", generated_token_ids=[first])
    got = _run(decode)["r"]
    assert [*got.token_ids] == reference.token_ids
    assert got.usage.kv_transferred_tokens == 0
    assert decode.runner.num_computed_tokens >= len(prompt)


def test_imported_kv_is_released_when_its_request_ends_before_admission(tiny_llama):
    prefill, decode = Engine(tiny_llama, **SETTINGS), Engine(tiny_llama, **SETTINGS)
    prompt = _prompts(5)[4]
    first, handoff = _prefill(prefill, prompt, _params(0), "r")
    free = decode.block_pool.num_free
    add_with_kv(decode, prompt, _params(0), handoff, request_id="r", generated_token_ids=[first])
    assert decode.block_pool.num_free == free - -(-len(prompt) // 16)  # held while waiting
    decode.abort("r")
    assert decode.block_pool.num_free == free


def test_imported_kv_must_leave_a_token_to_compute(tiny_llama):
    prefill, decode = Engine(tiny_llama, **SETTINGS), Engine(tiny_llama, **SETTINGS)
    prompt = _prompts(5)[4]
    _, handoff = _prefill(prefill, prompt, _params(0), "r")
    free = decode.block_pool.num_free
    with pytest.raises(ValueError, match="leave one"):
        add_with_kv(decode, prompt, _params(0), handoff, request_id="r")  # no first token
    assert decode.block_pool.num_free == free and not decode.has_unfinished()


def test_the_fingerprint_names_config_weights_and_dtype_not_the_folder(tiny_llama, tmp_path):
    import shutil

    from worker.models.fingerprint import model_fingerprint

    same = tmp_path / "another-name"
    shutil.copytree(tiny_llama, same)
    assert model_fingerprint(same, "float64") == model_fingerprint(tiny_llama, "float64")
    assert model_fingerprint(same, "float32") != model_fingerprint(tiny_llama, "float64")
    weights = next(same.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert model_fingerprint(same, "float64") != model_fingerprint(tiny_llama, "float64")
    engine = Engine(tiny_llama, **SETTINGS)
    assert kv_layout(engine).fingerprint == model_fingerprint(tiny_llama, "float64")


def test_held_imported_kv_never_keeps_the_head_of_the_queue_out(tiny_llama):
    # Prompts in one piece: the head needs all its blocks at once.
    settings = {**SETTINGS, "num_kv_blocks": 20, "enable_chunked_prefill": False,
                "max_num_batched_tokens": 2048}
    prefill, engine = Engine(tiny_llama, **settings), Engine(tiny_llama, **settings)
    rng = random.Random(7)
    head_prompt, held_prompt = ([rng.randrange(2, 1000) for _ in range(n)] for n in (300, 80))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    reference = Engine(tiny_llama, **SETTINGS).generate([head_prompt, held_prompt], params)
    first, handoff = _prefill(prefill, held_prompt, params, "held")
    engine.add_request(head_prompt, params, request_id="head")
    add_with_kv(engine, held_prompt, params, handoff, request_id="held",
                generated_token_ids=[first])
    # The head needs 19 of the 20 blocks; the held KV takes 5 of them.
    assert engine.block_pool.num_free == 15
    done = _run(engine)
    assert engine.scheduler.counters["kv_imports_dropped"] == 1  # given back, not deadlocked
    assert done["head"].token_ids == reference[0].token_ids
    assert done["held"].token_ids == reference[1].token_ids
    assert done["held"].usage.kv_transferred_tokens == 0  # recomputed, and said so
    assert engine.block_pool.num_free == 20
