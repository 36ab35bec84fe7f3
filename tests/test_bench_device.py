"""The device step benchmark (worker/bench/device/step_floor.py) on the CPU: its byte and
FLOP accounting against the model it loads, and a run end to end (figures not judged)."""

from __future__ import annotations

import torch

from worker import Engine
from worker.bench.device import step_floor


def test_the_floor_counts_the_weights_a_decode_step_reads_and_the_flops_of_a_chunk(tiny_llama):
    engine = Engine(tiny_llama, dtype="float32")
    config, model = engine.model_config, engine.model
    assert not config.tie_word_embeddings
    params = {name: p for name, p in model.named_parameters()}
    layers = sum(p.numel() for name, p in params.items() if ".layers." in name
                 or name.startswith("layers."))
    assert step_floor.layer_parameters(config) == layers
    everything = sum(p.numel() * p.element_size() for p in params.values())
    table = config.vocab_size * config.hidden_size * 4
    assert step_floor.decode_weight_bytes(engine) == everything - table
    # A chunk's attention: each of its tokens attends over every position up to its own.
    flops = step_floor.prefill_flops(config, 4, 2)
    attention = 4 * config.num_attention_heads * config.head_dim * (5 + 6) * \
        config.num_hidden_layers
    assert flops == 2 * layers * 2 + attention  # (neither chunk ends its prompt: no LM head)
    assert step_floor.kv_bytes_per_token(config, torch.bfloat16) == \
        config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2


def test_a_run_on_the_cpu_prints_and_returns_every_figure(tiny_llama):
    said: list[str] = []
    result = step_floor.measure(tiny_llama, "cpu", "float32", [2], context=24, steps=3,
                                prefill_tokens=32, copy_gib=2**-10, gemm_n=64,
                                say=said.append, modes=("eager", "torch"))
    assert result["bandwidth_gb_per_s"] > 0 and result["gemm_tflops"] > 0
    eager, gathering = result["decode"]
    assert (eager["mode"], gathering["mode"]) == ("eager", "torch")
    for row in (eager, gathering):
        assert row["batch"] == 2 and row["step_ms"] > 0 and row["floor_ms"] > 0
        assert 24 - 16 <= row["mean_context"] <= 24 + 16 + 8
        assert row["graph_replays"] == 0  # nothing is captured on a CPU
    assert [c["chunk"] for c in result["prefill"]] == [0, 1]
    assert len(said) == 2 + 2 + 2  # the limits, the batch in each mode, the two chunks
