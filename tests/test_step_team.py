"""The decode step as one parallel region whose master takes over a late partner's tasks
(csrc/step_team.h): the same bits as a region per loop, with and without take-overs, for
every kind of checkpoint and a wide one (ragged panels, vectorised attention, three layers);
the partner really computes tasks; steps without every projection packed keep a region per
loop."""

from __future__ import annotations

import pytest
import torch
from decode_fixtures import decode_step, prefilled
from kernel_fixtures import needs_kernel
from model_fixtures import KINDS, VOCAB, write_checkpoint
from transformers import LlamaConfig, LlamaForCausalLM

from producer.settings import CPU_DECODE_LAYERS, CPU_MATMUL, CPU_STEP_TEAM
from worker.host.cpu_kernels import cpu_kernels
from worker.models import load_model

ENV_SWITCH = CPU_DECODE_LAYERS.name
MATMUL_SWITCH = CPU_MATMUL.name
TEAM_SWITCH = CPU_STEP_TEAM.name


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("checkpoints")
    for kind in KINDS:
        write_checkpoint(kind, root / kind)
    # Wide enough that every projection has several panels, the last one ragged (80 and 144
    # columns), with biases; head_dim 32 takes the vectorised attention.
    torch.manual_seed(3)
    wide = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=80, intermediate_size=72, num_hidden_layers=3,
        num_attention_heads=5, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        initializer_range=0.1, rms_norm_eps=1e-5, attention_bias=True, mlp_bias=True))
    wide.save_pretrained(root / "wide")
    return root


@pytest.fixture
def team_of_two(monkeypatch):
    """Two torch threads (a team with a partner) and the native step on, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setenv(ENV_SWITCH, "1")
    monkeypatch.delenv(MATMUL_SWITCH, raising=False)
    yield
    torch.set_num_threads(threads)
    cpu_kernels().step_team_stall(0, 0)


def counts() -> tuple[int, int]:
    """(tasks taken over, tasks partners published) so far."""
    return cpu_kernels().step_team_counts()


def run_steps(model, lens: list[int], steps: int = 3):
    """Logits of ``steps`` teacher-forced decode steps after a prefill, and the cache (the
    same tokens at every call)."""
    seqs, tables, cache = prefilled(model, lens, seed=11)
    logits = []
    for step in range(steps):
        for i, s in enumerate(seqs):
            s.append((i * 17 + step * 5) % VOCAB)
        logits.append(decode_step(model, cache, seqs, tables, [1] * len(seqs)))
    return torch.stack(logits), cache


def assert_same_bits(a, b) -> None:
    (logits_a, cache_a), (logits_b, cache_b) = a, b
    assert not logits_a.isnan().any()
    assert torch.equal(logits_a, logits_b)
    for x, y in zip((*cache_a.k, *cache_a.v), (*cache_b.k, *cache_b.v), strict=True):
        assert torch.equal(x.nan_to_num(-7.0), y.nan_to_num(-7.0))  # written slots and NaN ones


# Runs of a step team until its partner has published tasks: a loaded machine may keep the
# partner off its core for a whole run.
ATTEMPTS = 20


@needs_kernel
@pytest.mark.usefixtures("team_of_two")
@pytest.mark.parametrize("kind, batch", [(kind, 6) for kind in KINDS]
                         + [("llama", 1), ("qwen2", 40), ("llama_tied_bias", 64), ("wide", 6),
                            ("wide", 40)])
def test_the_team_step_computes_the_bits_of_a_region_per_loop(kind, batch, checkpoints,
                                                               monkeypatch):
    model = load_model(checkpoints / kind, dtype=torch.float32)
    lens = ([1, 7, 8, 9, 40, 100, 3] * 10)[:batch]
    monkeypatch.setenv(TEAM_SWITCH, "0")
    before = counts()
    per_loop = run_steps(model, lens)
    assert counts() == before  # no team ran
    monkeypatch.setenv(TEAM_SWITCH, "1")
    for _ in range(ATTEMPTS):
        team = run_steps(model, lens)
        assert_same_bits(team, per_loop)
        if batch == 1 or counts()[1] > before[1]:
            break
    if batch > 1:
        assert counts()[1] > before[1]  # the partner computed and published tasks
    assert model.num_native_steps >= 6


@needs_kernel
@pytest.mark.usefixtures("team_of_two")
@pytest.mark.parametrize("kind", ["llama_tied_bias", "wide"])
def test_a_partner_late_with_its_tasks_has_them_taken_over_and_the_bits_stay(
        kind, checkpoints, monkeypatch):
    model = load_model(checkpoints / kind, dtype=torch.float32)
    lens = [1, 7, 8, 9, 40, 100, 3, 33] * 4
    monkeypatch.setenv(TEAM_SWITCH, "0")
    per_loop = run_steps(model, lens)
    monkeypatch.setenv(TEAM_SWITCH, "1")
    # Every third task a partner computes, it sleeps 3 ms before publishing it: far past the
    # master's patience (about twice the task's own time), as a partner that lost its core.
    cpu_kernels().step_team_stall(3, 3000)
    before = counts()
    for _ in range(ATTEMPTS):
        late = run_steps(model, lens)
        assert_same_bits(late, per_loop)
        taken, published = (a - b for a, b in zip(counts(), before, strict=True))
        if taken > 0 and published > 0:
            break
    assert taken > 0  # the precondition: the master did take tasks over
    assert published > 0  # and partners still published the others


@needs_kernel
@pytest.mark.usefixtures("team_of_two")
def test_a_step_without_packed_weights_keeps_a_region_per_loop(checkpoints, monkeypatch):
    monkeypatch.setenv(MATMUL_SWITCH, "unpacked")
    monkeypatch.setenv(TEAM_SWITCH, "1")
    model = load_model(checkpoints / "llama", dtype=torch.float32)
    before = counts()
    run_steps(model, [3, 9, 20])
    assert model.num_native_steps >= 3
    assert counts() == before
