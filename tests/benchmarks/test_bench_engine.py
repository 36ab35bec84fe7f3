"""pytest-benchmark suites for the engine core (CI runs each once with --benchmark-disable).

Measure with: .venv/bin/pytest tests/benchmarks --benchmark-only
"""

from __future__ import annotations

import random

import pytest

from producer.settings import CPU_DECODE_LAYERS
from worker import Engine, SamplingParams
from worker.bench.decode_step import kv_buffers, matmul_seconds, read_seconds, weight_shapes
from worker.bench.sampling_steps import MODES, decoding_engine
from worker.bench.step_overhead import HostStep, busy_scheduler
from worker.host.cpu_kernels import decode_layers_kernel

ENV_SWITCH = CPU_DECODE_LAYERS.name


def test_bench_schedule_256_running_1000_waiting(benchmark):
    s = busy_scheduler(256, 1000)
    for _ in range(200):  # until every running slot decodes: the measured step is steady
        out = s.schedule()
        s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
        if all(r.num_output_tokens for r in s.running):
            break

    def one_step():
        out = s.schedule()
        s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
        return out

    out = benchmark(one_step)
    assert len(out.chunks) == 256 and s.num_waiting == 1000


def test_bench_host_step_256_running_1000_waiting(benchmark):
    """Scheduler + the runner's block tables + attention metadata: the issue's <= 1 ms."""
    step = HostStep(busy_scheduler(256, 1000))
    out, meta = benchmark(step.one)
    assert len(out.chunks) == 256 and meta.num_tokens == 256
    assert step.scheduler.num_waiting == 1000


@pytest.fixture(scope="module")
def small_model(model_factory):
    return model_factory("small", preset="small", arch="llama")


@pytest.mark.parametrize("batch, layers", [(1, "native"), (16, "native"), (64, "native"),
                                           (64, "python"), (1, "native-overlapped"),
                                           (64, "native-overlapped")])
def test_bench_decode_small(benchmark, monkeypatch, small_model, batch, layers):
    """One decode step of `batch` requests with 128-token prompts on the small preset, its
    layers in one native call (the default on CPU) or in Python; "overlapped": each step
    scheduled while the one before runs (async_scheduling; off by default on CPU)."""
    monkeypatch.setenv(ENV_SWITCH, "0" if layers == "python" else "1")
    # Two threads to measure; one for the smoke run, which shares the cores with the suite.
    engine = Engine(small_model, dtype="float32", max_num_seqs=batch,
                    num_threads=1 if benchmark.disabled else 2,
                    max_num_batched_tokens=max(1024, 128 * batch),
                    async_scheduling=layers.endswith("overlapped"))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(2, 8000) for _ in range(128)], params)
    # Until every request decodes (overlapped: the step that gave the first tokens is over).
    while engine.scheduler.num_waiting or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ) or engine.num_steps < 3:
        engine.step()

    outputs = benchmark(engine.step)
    engine.close()  # the last step handed over (overlapped) has run
    assert len(outputs) == batch and all(len(o.new_token_ids) == 1 for o in outputs)
    # The native layers are CPU code: on CUDA every step runs the torch layers.
    assert (engine.model.num_native_steps > 0) == (engine.device.type == "cpu"
                                                   and layers != "python"
                                                   and decode_layers_kernel() is not None)
    assert (engine.num_overlapped_steps > 0) == layers.endswith("overlapped")
    benchmark.extra_info["tokens_per_step"] = batch


def test_bench_decode_64_matmuls_alone(benchmark, small_model):
    """The weight matmuls of one decode step at batch 64: what the step above is held to
    (`python -m worker.bench.decode_step` interleaves both and prints the ratio)."""
    import torch

    engine = Engine(small_model, dtype="float32", num_kv_blocks=16)
    shapes = weight_shapes(engine.model_config)
    weights = [torch.randn(o, i) for o, i in shapes]
    x = {w.shape[1]: torch.randn(64, w.shape[1]) for w in weights}
    assert benchmark(matmul_seconds, weights, x) > 0


def test_bench_decode_64_kv_read(benchmark, small_model):
    """One read of the KV a decode step's attention reads (`python -m worker.bench.decode_step`
    adds it to the step's matmuls: the step's floor on a CPU). Sized from the running
    sequences' contexts at the measurement's middle round."""
    smoke = benchmark.disabled
    engine = decoding_engine(small_model, "greedy", batch=4 if smoke else 64, threads=1,
                             prompt_tokens=16 if smoke else 128)
    config = engine.model_config
    buffers = kv_buffers(engine, rounds=3)
    contexts = sum(r.num_tokens for r in engine.scheduler.running)
    per_token = 2 * config.num_key_value_heads * config.head_dim  # K and V, floats
    assert len(buffers) == config.num_hidden_layers
    assert all(b.numel() == (contexts + 3 * len(engine.scheduler.running)) * per_token
               for b in buffers)
    assert benchmark(read_seconds, buffers) > 0


@pytest.fixture(scope="module")
def vocab_32000_model(tmp_path_factory):
    from worker.bench.sampling_steps import model_with_vocab

    return model_with_vocab(32000, tmp_path_factory.mktemp("vocab"))


# (a constrained mode needs the model's tokenizer: the 32,000-token checkpoint has none)
@pytest.mark.parametrize(("vocab", "mode"), [
    (vocab, mode) for vocab in (8192, 32000) for mode in MODES
    if vocab == 8192 or "response_format" not in MODES[mode]])
def test_bench_sampled_decode_step(benchmark, request, small_model, vocab, mode):
    """A decode step at batch 64 per sampling mode; compare each with its greedy case
    (`python -m worker.bench.sampling_steps` interleaves them and prints the ratios)."""
    model = small_model if vocab == 8192 else request.getfixturevalue("vocab_32000_model")
    # The smoke run (CI) only shows the path works: a small batch, short prompts.
    smoke = benchmark.disabled
    engine = decoding_engine(model, mode, batch=4 if smoke else 64,
                             threads=1 if smoke else 2, prompt_tokens=16 if smoke else 128)
    outputs = benchmark(engine.step)
    assert all(len(o.new_token_ids) == 1 for o in outputs)
    benchmark.extra_info.update(vocab=vocab, mode=mode)
