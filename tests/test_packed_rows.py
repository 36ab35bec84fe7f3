"""Up to how many rows decode matmuls take the packed copies: timed on the host when a CPU
engine is built (worker/models/packed_rows.py), or set by CONVEYOR_PACKED_MAX_ROWS; past the
limit the native step gets no packed copies, and its logits stay those of the Python layers."""

from __future__ import annotations

import pytest
import torch
from decode_fixtures import decode_step, prefilled
from kernel_fixtures import needs_kernel
from model_fixtures import VOCAB, write_checkpoint

import worker.cpu_kernels as kernel_loader
from worker.models import load_model, native_decode, packed_rows
from worker.models.native_decode import ENV_SWITCH


class FakeClock:
    """Time that moves only when a fake matmul says what it cost."""

    def __init__(self, cost) -> None:
        self.now = 0.0
        self.cost = cost  # (rows, packed?) -> seconds

    def __call__(self) -> float:
        return self.now

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, packed) -> None:
        self.now += self.cost(x.shape[0], packed is not None)


WEIGHTS = [torch.zeros(48, 16), torch.zeros(16, 16)]


def _limit(cost) -> int:
    clock = FakeClock(cost)
    return packed_rows.timed_limit(WEIGHTS, [torch.zeros(1)] * len(WEIGHTS), clock.matmul,
                                   clock=clock)


def test_the_limit_is_the_last_row_count_before_the_packed_copies_lose() -> None:
    # Packed: faster up to 32 rows, 1.4x the unpacked time past them.
    assert _limit(lambda rows, packed: rows * (0.8 if rows <= 32 else 1.4) if packed
                  else rows) == 32
    assert _limit(lambda rows, packed: rows * (0.5 if packed else 1.0)) == packed_rows.ROWS[-1]
    assert _limit(lambda rows, packed: rows * (2.0 if packed else 1.0)) == 0
    # A loss at one count ends the search even where the packed copies win again later.
    assert _limit(lambda rows, packed: rows * (1.5 if packed and rows == 16 else 1.0)) == 8


def test_a_difference_within_the_tie_counts_as_no_slower() -> None:
    within = packed_rows.TIE * 0.99
    assert _limit(lambda rows, packed: rows * (within if packed else 1.0)) == packed_rows.ROWS[-1]
    beyond = packed_rows.TIE * 1.01
    assert _limit(lambda rows, packed: rows * (beyond if packed else 1.0)) == 0


def test_the_environment_sets_the_limit_or_is_refused_clearly(monkeypatch) -> None:
    monkeypatch.delenv(packed_rows.ENV_LIMIT, raising=False)
    assert packed_rows.from_environment() is None
    monkeypatch.setenv(packed_rows.ENV_LIMIT, " 48 ")
    assert packed_rows.from_environment() == 48
    for bad in ("many", "-1", "1.5"):
        monkeypatch.setenv(packed_rows.ENV_LIMIT, bad)
        with pytest.raises(ValueError, match=packed_rows.ENV_LIMIT):
            packed_rows.from_environment()


@needs_kernel
def test_a_step_past_the_limit_takes_no_packed_copies_and_the_same_logits(
        tmp_path, monkeypatch) -> None:
    write_checkpoint("llama", tmp_path / "llama")
    monkeypatch.setenv(packed_rows.ENV_LIMIT, "4")
    model = load_model(tmp_path / "llama", dtype=torch.float32)
    native_decode.prepare(model)
    assert native_decode.packed_row_limit(model) == 4

    real = kernel_loader.decode_layers_kernel()
    packed_given = []

    def spy(*args):
        packed_given.append(len(args[8]))  # the projections' packed copies
        return real(*args)

    monkeypatch.setattr(kernel_loader, "decode_layers_kernel", lambda: spy)
    for batch in (3, 6):
        results = {}
        for switch in ("0", "1"):
            monkeypatch.setenv(ENV_SWITCH, switch)
            seqs, tables, cache = prefilled(model, [5, 9, 17, 2, 30, 11][:batch], seed=batch)
            for i, s in enumerate(seqs):
                s.append((i * 13 + batch) % VOCAB)
            results[switch] = decode_step(model, cache, seqs, tables, [1] * batch)
        assert not results["1"].isnan().any()
        torch.testing.assert_close(results["1"], results["0"], rtol=1e-4, atol=1e-4)
    # One native step per batch (the prefills and the Python layers' steps do not call it).
    assert packed_given[0] > 0 and packed_given[1] == 0
    assert len(packed_given) == 2
