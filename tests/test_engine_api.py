"""The offline engine's API: sampling, stopping, cancelling, resuming and rejecting bad input."""

from __future__ import annotations

import random

import pytest

from producer.clock import ManualClock
from worker import Engine, FinishReason, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(tiny_llama, dtype="float64", max_num_batched_tokens=128, num_kv_blocks=512)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, top_p=0.95, min_p=0.01,
                        seed=1234, ignore_eos=True)


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_batch(engine):
    (alone,) = engine.generate([prompt(40)], SEEDED)
    others = [prompt(10 + 7 * i, seed=i + 1) for i in range(15)]
    other_params = [SamplingParams(max_tokens=30, temperature=1.0, seed=i) for i in range(15)]
    batch = engine.generate([prompt(40)] + others, [SEEDED] + other_params)
    assert batch[0].token_ids == alone.token_ids
    # Sampling really sampled: a different seed gives different tokens.
    (reseeded,) = engine.generate([prompt(40)], SamplingParams(**{**SEEDED.to_dict(), "seed": 99}))
    assert reseeded.token_ids != alone.token_ids


@pytest.mark.parametrize("k", [1, 7, 23])
def test_seeded_request_restarted_at_token_k_continues_exactly(engine, k):
    (full,) = engine.generate([prompt(40)], SEEDED)
    rid = engine.add_request(prompt(40), SEEDED, generated_token_ids=full.token_ids[:k])
    rest = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            rest.extend(out.new_token_ids)
            if out.finished:
                assert out.completion.token_ids == full.token_ids
    assert full.token_ids[:k] + rest == full.token_ids


def test_every_block_is_free_after_all_requests_finish(engine):
    engine.generate([prompt(n, seed=n) for n in (1, 15, 16, 17, 100)],
                    SamplingParams(max_tokens=20, temperature=0))
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_usage_and_finish_reason(engine):
    (c,) = engine.generate([prompt(12)], SamplingParams(max_tokens=5, temperature=0,
                                                        ignore_eos=True))
    assert c.finish_reason is FinishReason.LENGTH
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (12, 5)
    assert len(c.token_ids) == 5


def test_text_prompt_and_stop_string_is_removed(engine):
    (free,) = engine.generate(["The river runs"], SamplingParams(max_tokens=30, temperature=0,
                                                                  ignore_eos=True))
    assert free.text
    stop = free.text[5:8]
    (stopped,) = engine.generate(["The river runs"],
                                 SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                stop=[stop]))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.text == free.text[: free.text.index(stop)]
    assert stop not in stopped.text


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_same_tokens(engine):
    (free,) = engine.generate(["The river runs"], SamplingParams(max_tokens=30, temperature=0,
                                                                  ignore_eos=True))
    stop = free.text[5:8]
    args = {"max_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    (cut,) = engine.generate(["The river runs"], SamplingParams(**args))
    (kept,) = engine.generate(["The river runs"], SamplingParams(
        **args, include_stop_str_in_output=True))
    assert kept.finish_reason is FinishReason.STOP and kept.token_ids == cut.token_ids
    assert kept.text == cut.text + stop == free.text[: free.text.index(stop) + len(stop)]


def test_skip_special_tokens_false_keeps_their_text(engine, tiny_llama):
    """The model's EOS generated past (ignore_eos) is text when skip_special_tokens is false,
    and nothing by default; the tokens are the same."""
    from worker.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_llama)
    eos = min(engine.eos_token_ids)
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True,
              "logit_bias": {str(eos): 100}}
    (plain,) = engine.generate(["The river runs"], SamplingParams(**params))
    (kept,) = engine.generate(["The river runs"], SamplingParams(
        **params, skip_special_tokens=False))
    assert plain.token_ids == kept.token_ids == [eos] * 12  # precondition: EOS, every step
    assert plain.text == "" and kept.text == tok.decode([eos] * 12, skip_special_tokens=False)
    assert kept.text != ""


@pytest.mark.parametrize("overlapped", [False, True])
def test_min_tokens_keeps_eos_out_of_the_draw_as_transformers_does(tiny_llama, overlapped):
    """EOS pushed to the top by a bias: drawn at once without min_tokens, only after five
    tokens with it, and those five are transformers' (min_new_tokens, the same bias)."""
    from hf_reference import hf_min_new_tokens

    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=64, async_scheduling=overlapped)
    eos = min(engine.eos_token_ids)
    params = {"max_tokens": 20, "temperature": 0, "logit_bias": {str(eos): 100}}
    (free,) = engine.generate([prompt(12)], SamplingParams(**params))
    assert free.token_ids == [eos] and free.finish_reason is FinishReason.STOP  # precondition
    (held,) = engine.generate([prompt(12)], SamplingParams(**params, min_tokens=5))
    assert held.finish_reason is FinishReason.STOP and len(held.token_ids) == 6
    assert held.token_ids == hf_min_new_tokens(tiny_llama, prompt(12), 20, 5, {eos: 100.0})
    assert eos not in held.token_ids[:5] and held.token_ids[5] == eos


def test_min_tokens_holds_stop_tokens_and_stop_strings_until_then(engine):
    (free,) = engine.generate(["The river runs"], SamplingParams(max_tokens=12, temperature=0,
                                                                  ignore_eos=True))
    target = free.token_ids[0]
    forced = {"max_tokens": 12, "temperature": 0, "ignore_eos": True,
              "logit_bias": {str(target): 100}, "stop_token_ids": [target]}
    (stopped,) = engine.generate(["The river runs"], SamplingParams(**forced))
    assert stopped.token_ids == [target]  # precondition: the stop token comes first
    (held,) = engine.generate(["The river runs"], SamplingParams(**forced, min_tokens=3))
    assert len(held.token_ids) == 4 and held.token_ids[3] == target
    assert target not in held.token_ids[:3] and held.finish_reason is FinishReason.STOP
    # A stop string in the first tokens' text ends nothing before min_tokens: the whole text.
    stop = free.text[:2]
    args = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    (cut,) = engine.generate(["The river runs"], SamplingParams(**args))
    assert cut.text == "" and cut.finish_reason is FinishReason.STOP  # precondition
    (whole,) = engine.generate(["The river runs"], SamplingParams(**args, min_tokens=12))
    assert whole.token_ids == free.token_ids and whole.text == free.text
    assert whole.finish_reason is FinishReason.LENGTH


def test_streamed_text_deltas_add_up_to_the_completion_text(engine):
    params = SamplingParams(max_tokens=25, temperature=0.7, seed=3, ignore_eos=True, stop=["zzq"])
    engine.add_request("Tell me about the lighthouse", params)
    deltas = []
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.text_delta)
            if out.finished:
                assert "".join(deltas) == out.completion.text


def test_stop_token_ids_and_logprobs(engine):
    (free,) = engine.generate([prompt(20)], SamplingParams(max_tokens=10, temperature=0,
                                                           ignore_eos=True, logprobs=3))
    assert len(free.logprobs) == 10
    first = free.logprobs[0]
    assert first.token_id == free.token_ids[0] and len(first.top) == 3
    assert first.top[0][0] == free.token_ids[0]  # greedy picks the most likely token
    target = free.token_ids[4]
    (stopped,) = engine.generate([prompt(20)], SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[target]))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(target) + 1]


def test_abort_a_running_request_frees_its_blocks(engine):
    keep = engine.add_request(prompt(30), SamplingParams(max_tokens=8, temperature=0))
    doomed = engine.add_request(prompt(30, seed=5), SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    final = engine.abort(doomed)
    assert final.finished and final.finish_reason is FinishReason.CANCELLED
    assert engine.abort("unknown-id") is None
    finished = set()
    while engine.has_unfinished():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {keep}
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


@pytest.mark.parametrize(
    ("bad_prompt", "params", "match"),
    [
        ([5] * 3000, {}, "max length"),
        ("", {}, "empty"),
        ([], {}, "non-empty"),
        ([5, 10**6], {}, "outside the vocabulary"),
        ([5, -1], {}, "outside the vocabulary"),
        ([5, 6], {"max_tokens": 0}, "max_tokens"),
        ([5, 6], {"no_such_knob": 1}, "unknown sampling parameter"),
        ([5, 6], {"temperature": -0.5}, "temperature"),
        ([5, 6], {"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_input_raises_a_clear_value_error_and_the_engine_keeps_serving(
    engine, bad_prompt, params, match
):
    good = engine.add_request(prompt(8), SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match=match):
        engine.add_request(bad_prompt, params)
    done = {o.request_id for _ in range(10) for o in engine.step() if o.finished}
    assert good in done and not engine.has_unfinished()


def test_bad_request_id_and_unknown_engine_setting(engine, tiny_llama):
    with pytest.raises(ValueError, match="request id"):
        engine.add_request([5, 6], request_id="has:colon")
    with pytest.raises(ValueError, match="unknown engine setting"):
        Engine(tiny_llama, blok_size=16)


def test_request_larger_than_the_whole_pool_is_rejected(tiny_llama):
    small_pool = Engine(tiny_llama, num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="whole KV pool"):
        small_pool.add_request(prompt(60), SamplingParams(max_tokens=10))


def test_model_without_tokenizer_takes_token_ids(tmp_path):
    from worker.modelgen import make_model

    model_dir = make_model(tmp_path / "bare", preset="tiny", with_tokenizer=False)
    bare = Engine(model_dir, dtype="float64")
    (c,) = bare.generate([prompt(5)], SamplingParams(max_tokens=4, temperature=0,
                                                      ignore_eos=True))
    assert len(c.token_ids) == 4 and c.text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.add_request("text needs a tokenizer")


def test_deadline_expires_a_waiting_and_a_running_request_keeping_their_tokens(tiny_llama):
    clock = ManualClock()
    engine = Engine(tiny_llama, clock=clock, dtype="float64", num_kv_blocks=512)
    running = engine.add_request(prompt(10), SamplingParams(max_tokens=500, temperature=0,
                                                            ignore_eos=True),
                                 deadline=clock.time() + 0.3)
    late = engine.add_request(prompt(10), SamplingParams(max_tokens=5, temperature=0),
                              deadline=clock.time() - 1)
    finals = {}
    produced = 0
    for _ in range(5):  # before its deadline, the running request generates
        for out in engine.step():
            produced += len(out.new_token_ids) if out.request_id == running else 0
            if out.finished:
                finals[out.request_id] = out.completion
    assert running not in finals and produced == 5
    clock.advance(0.3)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.completion
    assert finals[late].finish_reason is FinishReason.EXPIRED and finals[late].token_ids == []
    assert finals[running].finish_reason is FinishReason.EXPIRED
    assert len(finals[running].token_ids) == 5
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_a_stale_deadline_never_expires_a_later_request_that_reuses_the_id(tiny_llama):
    clock = ManualClock()
    engine = Engine(tiny_llama, clock=clock, dtype="float64", num_kv_blocks=512)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request(prompt(5), greedy, request_id="same", deadline=clock.time() + 10)
    while engine.has_unfinished():
        engine.step()
    engine.add_request(prompt(5), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                       request_id="same")
    clock.advance(20)  # past the first request's deadline; the second has none
    finals = [o for _ in range(40) for o in engine.step() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in finals] == [("same", FinishReason.LENGTH)]


def test_without_max_tokens_a_request_runs_to_the_context_or_the_pool_whichever_is_less(
        tiny_llama):
    # 8 blocks of 16: the pool holds 128 tokens, far less than the model's 2,048 context.
    engine = Engine(tiny_llama, dtype="float32", num_kv_blocks=8)
    prompt = list(range(3, 23))
    [done] = engine.generate([prompt], SamplingParams(temperature=0, ignore_eos=True))
    assert done.finish_reason == FinishReason.LENGTH
    assert len(prompt) + len(done.token_ids) == 8 * 16
    roomy = Engine(tiny_llama, dtype="float32", num_kv_blocks=256, max_model_len=64)
    [done] = roomy.generate([prompt], SamplingParams(temperature=0, ignore_eos=True))
    assert len(prompt) + len(done.token_ids) == 64 and done.finish_reason == FinishReason.LENGTH


def test_on_a_gpu_the_kv_pool_takes_what_the_weights_and_a_steps_activations_leave():
    """num_kv_blocks not given, on CUDA: the pool is what the GPU has free with the weights
    loaded, less 1 - gpu_memory_utilization of its memory and a step's activations (sized
    here with an H200's numbers: nothing is allocated)."""
    import torch

    from kvstore.kv_tensors import PagedKVCache
    from worker.engine.config import EngineConfig
    from worker.engine.memory import cuda_kv_blocks, gather_share, step_activation_bytes
    from worker.modelgen import ARCHS, PRESETS
    from worker.modelgen.config_json import build_config
    from worker.models.config import ModelConfig

    eight = PRESETS["8b"]
    model = ModelConfig.from_dict(build_config(eight, ARCHS["llama"], 8, False,
                                               eight.rope_scaling, "bfloat16"))
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    per_block = PagedKVCache.bytes_per_block(32, 16, 8, 128, torch.bfloat16)
    assert per_block == 16 * 128 * 2**10  # 128 KiB a token
    reserve = step_activation_bytes(config, model, torch.bfloat16)
    assert 2**28 < reserve < 2**32  # a step's transients: hundreds of MiB, not the GPU
    gib = 2**30
    total, free = 140 * gib, 124 * gib  # an H200 with 16 GiB of weights loaded
    # Each block with its share of the decode step's K/V gather: 1.5 of a layer's 32.
    with_gather = int(per_block * (1 + 1.5 / 32))

    torch_share = gather_share(None, 32)

    def blocks(cfg, useful=10**9, free=free, share=torch_share):
        return cuda_kv_blocks(cfg, per_block, useful, reserve, lambda: (free, total), share)

    assert blocks(config) == (free - 14 * gib - reserve) // with_gather
    assert blocks(config) * 16 >= 64 * 1024  # batch 64 at 1k context fits, with room to spare
    assert blocks(config, useful=100) == 100
    # The paged backend reads the pool in place: no gather to leave room for.
    assert blocks(config, share=0.0) == (free - 14 * gib - reserve) // per_block
    tighter = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048,
                           gpu_memory_utilization=0.5)
    assert blocks(tighter) == (free - 70 * gib - reserve) // with_gather
    with pytest.raises(MemoryError, match="no GPU memory left for the KV cache"):
        blocks(config, free=14 * gib)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0)
