"""The sampler against plain references: each filter keeps what its definition says, draws
follow the kept distribution, penalties and logit bias change exactly the logits they
name, and a seeded row is the same alone and in any batch."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from kernel_fixtures import kernels_missing, needs_kernel

from producer.settings import CPU_KERNELS
from producer.wire.params import SamplingParams
from producer.wire.protocol import GenerationRequest
from worker.host.cpu_kernels import penalize_kernel, sample_rows_kernel
from worker.host.step_upload import StepUpload
from worker.sampling import Sampler, SampleRequest
from worker.sampling.filters import BINS_PER_NAT, NUM_BINS, floors, top_p_keep
from worker.sampling.penalties import apply_penalties
from worker.sampling.sampler import step_rows
from worker.sampling.subsets import RowSubsets

KERNELS_SWITCH = CPU_KERNELS.name

DRAWS = 4000
kernel = sample_rows_kernel()


@pytest.fixture(params=["kernel", "torch"])
def draw_path(request, monkeypatch):
    """Float32 CPU rows are drawn by the kernel (csrc/sample_rows.cpp) where it is built and
    by torch ops elsewhere (CUDA, or with the kernels off): both follow one definition."""
    if request.param == "kernel":
        if kernel is None:
            kernels_missing()
    else:
        monkeypatch.setenv(KERNELS_SWITCH, "0")
        assert sample_rows_kernel() is None
    return request.param


def row(seed: int = 0, index: int = 0, prompt=(), output=(), **params) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), seed, index, prompt, output)


def reference_distribution(logits: list[float], temperature: float = 1.0, top_k: int = 0,
                           top_p: float = 1.0, min_p: float = 0.0) -> list[float]:
    """The filtered distribution, the textbook way: sort, cut, renormalise."""
    x = [v / temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if top_k:
        for i in order[top_k:]:
            x[i] = -math.inf
    top = max(x)
    p = [math.exp(v - top) for v in x]
    total = sum(p)
    p = [v / total for v in p]
    keep, mass = set(), 0.0
    for i in order:
        if mass >= top_p and keep:
            break
        keep.add(i)
        mass += p[i]
    p = [v if i in keep and v >= min_p * max(p) else 0.0 for i, v in enumerate(p)]
    total = sum(p)
    return [v / total for v in p]


def empirical(logits: list[float], **params) -> list[float]:
    """Frequencies of DRAWS draws, one per seed (the draws are a function of the seed)."""
    sampler = Sampler()
    batch = torch.tensor([logits] * DRAWS, dtype=torch.float32)
    tokens, _ = sampler(batch, [row(seed=s, **params) for s in range(DRAWS)])
    counts = Counter(tokens)
    return [counts[i] / DRAWS for i in range(len(logits))]


LOGITS = [2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0]


@pytest.mark.parametrize("params", [
    {"temperature": 1.0},
    {"temperature": 0.5},
    {"temperature": 1.0, "top_k": 3},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 1.3, "top_p": 0.5},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "min_p": 0.05},
], ids=str)
def test_draws_follow_the_filtered_distribution(params, draw_path):
    want = reference_distribution(LOGITS, **params)
    got = empirical(LOGITS, **params)
    for token, (p, f) in enumerate(zip(want, got, strict=True)):
        if p == 0.0:
            assert f == 0.0, f"token {token} is filtered out but was drawn"
        else:  # 5 standard deviations of a frequency over DRAWS draws
            assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / DRAWS) + 1e-9, (token, p, f)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.9, 0.99, 0.999])
def test_top_p_keeps_the_smallest_set_reaching_p_and_its_near_ties(top_p):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(16, 32000, generator=generator, dtype=torch.float64) * 3
    probs = torch.softmax(x, dim=-1)
    keep = top_p_keep(x, probs, torch.full((16,), top_p))
    for r in range(16):
        order = probs[r].argsort(descending=True)
        mass = probs[r][order].cumsum(0)
        exact = order[:int(torch.searchsorted(mass, torch.tensor(top_p, dtype=mass.dtype))) + 1]
        assert bool(keep[r][exact].all())  # the exact set is kept...
        extra = keep[r].clone()
        extra[exact] = False
        # ...and beyond it only tokens within one bin (1/512 nat) of its least likely one.
        if extra.any():
            assert float(x[r][exact].min() - x[r][extra].min()) < 1 / BINS_PER_NAT
        assert int(extra.sum()) <= 0.001 * 32000


@needs_kernel
@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0])
@pytest.mark.parametrize("vocab", [5, 1000, 32003])
def test_the_draw_kernel_picks_the_inverse_cdf_token_of_what_is_kept(scale, vocab):
    """Against float64 torch: the kept set is top-k with top-p over it (filters.floors' floor)
    or else top_p_keep's cut, and min-p's floor, of the softmax at each row's temperature; the
    pick is the token whose CDF interval holds the draw (to rounding)."""
    generator = torch.Generator().manual_seed(vocab)
    rows = 48
    logits = torch.randn(rows, vocab, generator=generator) * scale
    logits[::5, 1::2] = float("-inf")  # some rows with half their tokens banned
    temperature = torch.tensor([[1.0, 0.7, 1.3][r % 3] for r in range(rows)],
                               dtype=torch.float64)
    top_p = torch.tensor([[1.0, 0.9, 0.5, 0.05, 0.999, 1e-9][r % 6] for r in range(rows)],
                         dtype=torch.float64)
    # Top-k on some rows (7 is the whole row at vocab 5: no cut), with each row's top-p.
    top_k = torch.tensor([[0, 0, 0, 50, 0, 1, 0, 7][r % 8] for r in range(rows)])
    min_p = torch.tensor([[0.0, 0.1, 0.0, 0.0][r % 4] for r in range(rows)],
                         dtype=torch.float64)
    draws = torch.rand(rows, generator=generator, dtype=torch.float64)
    picks = kernel(logits, temperature, top_p, top_k, min_p, draws, BINS_PER_NAT,
                   NUM_BINS).tolist()

    x64 = (logits / temperature.float()[:, None]).double()  # scaled in float32, as torch does
    p64 = torch.softmax(x64, dim=-1)
    ranked = (top_k > 0) & (top_k < vocab)
    cut = floors(x64, RowSubsets([SamplingParams(temperature=1.0, top_k=int(k), top_p=float(p),
                                                 min_p=float(m))
                                  for k, p, m in zip(top_k, top_p, min_p, strict=True)],
                                 StepUpload("cpu"), vocab))
    nucleus = top_p_keep(x64, p64, torch.where(ranked, 1.0, top_p))
    keep = (x64 >= cut) & torch.where(ranked[:, None], True, nucleus)
    kept = p64 * keep
    cdf = kept.cumsum(dim=-1)
    for r, pick in enumerate(picks):
        assert keep[r, pick] and kept[r, pick] > 0, (r, pick)
        total = float(cdf[r, -1])
        target, tol = float(draws[r]) * total, 1e-6 * total
        assert float(cdf[r, pick]) - float(kept[r, pick]) <= target + tol, (r, pick)
        assert float(cdf[r, pick]) >= target - tol, (r, pick)
    # A tiny top-p keeps the best token alone (and its near-ties, of which random rows have
    # none).
    tiny = [r for r in range(rows) if top_p[r] < 1e-6 and not ranked[r]]
    assert tiny and all(picks[r] == int(logits[r].argmax()) for r in tiny)


@needs_kernel
def test_the_draw_kernel_is_the_same_for_a_row_alone_and_in_a_batch():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(33, 32000, generator=generator) * 4
    columns = (torch.full((33,), 0.8, dtype=torch.float64),  # temperature
               torch.full((33,), 0.9, dtype=torch.float64),  # top-p
               torch.tensor([[0, 40][r % 2] for r in range(33)]),  # top-k
               torch.tensor([[0.0, 0.0, 0.05][r % 3] for r in range(33)],
                            dtype=torch.float64),  # min-p
               torch.rand(33, generator=generator, dtype=torch.float64))  # draws
    batch = kernel(logits, *columns, BINS_PER_NAT, NUM_BINS)
    for r in (0, 17, 32):
        alone = kernel(logits[r:r + 1], *(c[r:r + 1] for c in columns), BINS_PER_NAT,
                       NUM_BINS)
        assert int(alone) == int(batch[r])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert torch.equal(kernel(logits, *columns, BINS_PER_NAT, NUM_BINS), batch)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_the_draw_kernel_refuses_a_row_without_a_positive_temperature():
    logits = torch.zeros(2, 10)
    ones = torch.ones(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="positive temperature"):
        kernel(logits, torch.tensor([1.0, 0.0], dtype=torch.float64), ones,
               torch.zeros(2, dtype=torch.long), ones * 0, ones * 0.5, BINS_PER_NAT, NUM_BINS)


def test_penalties_match_a_plain_reference():
    vocab = 12
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, vocab, generator=generator, dtype=torch.float64)
    rows = [
        row(prompt=[1, 2], output=[3, 3, 4], temperature=0, presence_penalty=0.5,
            frequency_penalty=0.25),
        row(prompt=[5, 6, 6], output=[7], temperature=0, repetition_penalty=1.7),
        row(prompt=[1], output=[1, 2], temperature=0),  # no penalty: untouched
    ]
    want = logits.clone()
    for r, req in enumerate(rows):
        p = req.params
        counts = Counter(req.output_token_ids)
        seen = set(req.prompt_token_ids) | set(req.output_token_ids)
        for t in range(vocab):
            v = float(want[r, t])
            if t in seen and p.repetition_penalty != 1.0:
                v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            v -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
            want[r, t] = v
    penalized = logits.clone()
    step = step_rows(rows, logits.device, vocab)
    apply_penalties(penalized, step.penalties)
    assert torch.allclose(penalized, want, rtol=0, atol=1e-12)
    assert not torch.equal(penalized[:2], logits[:2]) and torch.equal(penalized[2], logits[2])


def penalty_rows(generator: torch.Generator, rows: int, vocab: int) -> list[SampleRequest]:
    """Rows with every mix of penalties over random prompts and outputs (tokens repeat)."""
    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()
    kinds = [{"repetition_penalty": 1.3}, {"presence_penalty": 0.4},
             {"frequency_penalty": -0.3}, {},
             {"repetition_penalty": 0.8, "presence_penalty": -1.0, "frequency_penalty": 0.7}]
    return [row(prompt=tokens(1 + r % 7 * 5), output=tokens(r % 11 * 9), temperature=0,
                **kinds[r % len(kinds)]) for r in range(rows)]


@needs_kernel
def test_the_penalty_kernel_changes_the_logits_as_the_torch_path_does(monkeypatch):
    generator = torch.Generator().manual_seed(11)
    rows = penalty_rows(generator, 40, 300)
    step = step_rows(rows, torch.device("cpu"), 300)
    assert step.penalties.context.shape[1] > 300 and step.penalties.outputs.shape[1] > 300
    logits = torch.randn(len(rows), 300, generator=generator) * 4
    native = logits.clone()
    apply_penalties(native, step.penalties)
    monkeypatch.setenv(KERNELS_SWITCH, "0")
    assert penalize_kernel() is None
    plain = logits.clone()
    apply_penalties(plain, step.penalties)
    assert torch.equal(native, plain)  # the same float32 arithmetic, bit for bit
    assert not torch.equal(native, logits)


@needs_kernel
def test_the_penalty_kernel_refuses_a_token_outside_the_logits_and_changes_nothing():
    logits = torch.zeros(2, 5)
    inside = torch.tensor([[0, 1], [4, 2]])
    for context, outputs in ((torch.tensor([[0, 2], [1, 1]]), inside),
                             (inside, torch.tensor([[1, 1], [3, 5]]))):
        with pytest.raises(RuntimeError, match="outside the logits"):
            penalize_kernel()(logits, context, torch.full((2,), 2.0, dtype=torch.float64),
                              outputs, torch.ones(2, dtype=torch.float64))
        assert torch.equal(logits, torch.zeros(2, 5))


def test_penalties_change_the_greedy_pick_as_defined():
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0]])
    plain, _ = Sampler()(logits, [row(output=[1, 1], temperature=0)])
    presence, _ = Sampler()(logits, [row(output=[1, 1], temperature=0, presence_penalty=0.2)])
    # 3.0 - 0.05 x 1 stays ahead of 2.9; 3.0 - 0.05 x 3 does not.
    once, _ = Sampler()(logits, [row(output=[1], temperature=0, frequency_penalty=0.05)])
    frequency, _ = Sampler()(logits, [row(output=[1, 1, 1], temperature=0,
                                          frequency_penalty=0.05)])
    repetition, _ = Sampler()(logits, [row(prompt=[1], temperature=0, repetition_penalty=1.1)])
    assert (plain, presence, once, frequency, repetition) == ([1], [2], [1], [2], [2])


def test_logit_bias_bans_and_forces_tokens_and_logprobs_stay_the_models():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]] * 2)
    tokens, logprobs = Sampler()(logits, [
        row(temperature=0, logit_bias={1: -100}, logprobs=1),
        row(temperature=1.0, seed=5, logit_bias={"0": 100}),
    ])
    assert tokens == [2, 0]
    assert logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))


def test_scratch_logits_take_penalties_in_place_unless_logprobs_are_asked_for():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 50, generator=generator)
    rows = [row(output=[7, 7], temperature=0, frequency_penalty=0.7, logit_bias={3: 2.0}),
            row(seed=1, output=[9], temperature=0.8, presence_penalty=0.5),
            row(output=[1], temperature=0)]
    kept = logits.clone()
    want, _ = Sampler()(kept, rows)
    assert torch.equal(kept, logits)  # not scratch: the caller's logits are left alone
    scratch = logits.clone()
    assert Sampler()(scratch, rows, scratch=True)[0] == want
    assert not torch.equal(scratch, logits)  # penalised where they lay, no copy made
    asking = [*rows[:2], row(output=[1], temperature=0, logprobs=0)]
    scratch = logits.clone()
    tokens, logprobs = Sampler()(scratch, asking, scratch=True)
    assert tokens == want and torch.equal(scratch, logits)
    assert logprobs[2].logprob == pytest.approx(
        float(torch.log_softmax(logits[2], -1)[want[2]]))


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch(draw_path):
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 500, generator=generator)
    mine = row(seed=42, index=9, temperature=0.9, top_p=0.8, top_k=40,
               presence_penalty=0.3, output=[5, 6])
    others = [row(seed=s, temperature=t, top_p=p, min_p=m, logit_bias=b, output=[1])
              for s, t, p, m, b in [(1, 0, 1.0, 0.0, {}), (2, 1.5, 0.3, 0.0, {3: 5}),
                                    (3, 0.7, 1.0, 0.1, {}), (4, 1.0, 0.95, 0.0, {}),
                                    (5, 0.2, 1.0, 0.0, {9: -100})]]
    alone, _ = Sampler()(logits[:1], [mine])
    for position in range(6):
        batch = others[:position] + [mine] + others[position:]
        rows_logits = torch.cat([logits[1:position + 1], logits[:1], logits[position + 1:]])
        tokens, _ = Sampler()(rows_logits, batch)
        assert tokens[position] == alone[0]


def test_params_carry_penalties_and_logit_bias_on_the_wire():
    params = SamplingParams(presence_penalty=-1.5, frequency_penalty=2.0,
                            repetition_penalty=1.2, logit_bias={"17": -100, 3: 0.5})
    assert params.logit_bias == ((3, 0.5), (17, -100.0))
    assert SamplingParams.from_dict(params.to_dict()) == params
    # Through the request entry a worker decodes (msgpack maps with string keys only).
    entry = GenerationRequest(request_id="r1", model="m", prompt_token_ids=[1, 2],
                              params=params)
    assert GenerationRequest.decode(entry.encode()).params == params


@pytest.mark.parametrize("bad", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
    {"repetition_penalty": 11}, {"logit_bias": {"1": 101}}, {"logit_bias": {"x": 1}},
    {"logit_bias": {True: 1}}, {"logit_bias": [1, 2]}, {"logit_bias": {"1": "a"}},
    {"logit_bias": {str(i): 1 for i in range(1025)}},
], ids=str)
def test_bad_penalties_and_biases_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("params", [
    {"temperature": 0.9, "seed": 5, "presence_penalty": 1.0, "frequency_penalty": 0.5},
    {"temperature": 0.0, "repetition_penalty": 1.5, "logit_bias": {3: 2.0}},
    {"temperature": 1.1, "seed": 9, "top_p": 0.8, "repetition_penalty": 1.3},
], ids=["presence+frequency", "repetition+bias", "top_p+repetition"])
def test_penalised_requests_resume_exactly_and_ignore_their_batch(tiny_llama, params):
    from worker import Engine

    prompt = [5, 6, 7, 5, 6, 7, 9]
    sp = SamplingParams(max_tokens=24, ignore_eos=True, **params)
    engine = Engine(tiny_llama, dtype="float64")
    [alone] = engine.generate([prompt], [sp])
    others = [SamplingParams(max_tokens=30, temperature=1.0, seed=s, ignore_eos=True,
                             frequency_penalty=0.2 * s) for s in range(5)]
    batch = engine.generate([prompt] + [[8, 9, 10 + s] for s in range(5)], [sp] + others)
    assert batch[0].token_ids == alone.token_ids
    for k in (1, 7, 23):
        rid = engine.add_request(prompt, sp, generated_token_ids=alone.token_ids[:k])
        tail = []
        while engine.has_unfinished():
            tail += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
        assert alone.token_ids[:k] + tail == alone.token_ids


def test_a_top_k_of_the_whole_vocabulary_cuts_nothing_and_rows_laid_out_for_another_width_fail(
        monkeypatch):
    """Subsets are worked out before the logits exist, from the width the runner gives: a
    top-k at or past it is no cut (topk could not take it), and logits of another width are
    refused rather than filtered by the wrong subsets."""
    monkeypatch.setenv(KERNELS_SWITCH, "0")  # the torch path, CUDA's
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    rows = [row(seed=1, temperature=1.0, top_k=100), row(seed=2, temperature=1.0, top_k=50)]
    step = step_rows(rows, logits.device, 50)
    assert step.subsets.top_k == [0, 0] and not step.subsets.ranked
    assert Sampler()(logits, step)[0] == Sampler()(logits, rows)[0]
    wider = step_rows(rows, logits.device, 200)
    with pytest.raises(ValueError, match="200 logits a row, not 50"):
        Sampler()(logits, wider)


def test_min_tokens_keeps_eos_and_stop_tokens_out_of_a_call_of_its_own():
    """SampleRequest rows: EOS (given with the row) and the row's stop tokens are never
    drawn below min_tokens, whatever their logits; from min_tokens on they are."""
    logits = torch.zeros(2, 8)
    logits[:, 3] = 50.0  # EOS, far ahead
    logits[:, 5] = 40.0  # the stop token, next
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    rows = [SampleRequest(params, 1, index, eos_token_ids=[3]) for index in (1, 2)]
    tokens, _ = Sampler()(logits.clone(), rows)
    assert tokens == [0, 3]  # below min_tokens: the best token left; at it: EOS
