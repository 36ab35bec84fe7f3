"""One host-to-device copy a step (worker/host/step_upload.py): what is staged comes back intact
from the one packed buffer, and an engine whose every step packs its inputs as on a device
sends each step's inputs once and gives the tokens of one that does not pack.

On the CPU nothing needs moving, so the packed path is forced here (``pack=True``): the
layout, the attention plan's staged half, the sampling values, penalties and subsets all
go through the one buffer and its views, as on CUDA. That the GPU then makes one
"Memcpy HtoD" a step is tests/gpu's to show (worker/bench/step_copies.py counts them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_device_discipline import run, workload

import worker.attention.metadata as metadata_module
import worker.attention.torch_backend as torch_backend
import worker.engine.model_runner as model_runner
import worker.sampling.sampler as sampler_module
from producer.settings import CPU_KERNELS
from worker import Engine
from worker.host.step_upload import StepUpload

ENV_SWITCH = CPU_KERNELS.name


def test_packed_arrays_come_back_with_their_values_shapes_and_dtypes():
    ints = np.arange(12, dtype=np.int64).reshape(3, 4) - 5
    floats = np.array([[0.1, -2.5], [1e300, float("inf")]], dtype=np.float64)
    empty = np.empty((2, 0), dtype=np.int64)
    upload = StepUpload("cpu", pack=True)
    staged = [upload.add(a) for a in (ints, floats, empty, torch.tensor([7, 8]))]
    with pytest.raises(RuntimeError, match="before"):
        _ = staged[0].tensor
    upload.send()
    got = [s.tensor for s in staged]
    assert [t.dtype for t in got] == [torch.int64, torch.float64, torch.int64, torch.int64]
    assert got[0].tolist() == ints.tolist() and got[1].tolist() == floats.tolist()
    assert got[2].shape == (2, 0) and got[3].tolist() == [7, 8]
    # All views of one buffer: one copy moved them.
    assert len({t.untyped_storage().data_ptr() for t in got if t.numel()}) == 1


def test_an_upload_takes_no_other_dtype_and_is_sent_once():
    upload = StepUpload("cpu", pack=True)
    with pytest.raises(TypeError, match="int64 and float64"):
        upload.add(np.zeros(3, dtype=np.int32))
    upload.send()
    with pytest.raises(RuntimeError, match="already sent"):
        upload.send()
    with pytest.raises(RuntimeError, match="already sent"):
        upload.add(np.zeros(3, dtype=np.int64))


def test_on_the_cpu_an_array_is_its_tensor_at_once_and_nothing_is_packed():
    array = np.arange(5, dtype=np.int64)
    upload = StepUpload("cpu")
    staged = upload.add(array)
    assert not upload.packs and staged.tensor.data_ptr() == array.ctypes.data
    upload.send()
    assert upload.copies == 0


def test_a_device_gets_one_copy_of_every_array_in_shape():
    """On a device (meta here: shapes without data) the views keep each array's shape and
    dtype, and the upload counts its one copy."""
    upload = StepUpload("meta")
    staged = [upload.add(np.zeros((3, 2), dtype=np.int64)), upload.add(np.ones(4))]
    upload.send()
    assert [(s.tensor.device.type, tuple(s.tensor.shape), s.tensor.dtype) for s in staged] == [
        ("meta", (3, 2), torch.int64), ("meta", (4,), torch.float64)]
    assert upload.packs and upload.copies == 1


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_every_step_sends_its_inputs_once_and_packing_changes_no_token(tiny_llama, monkeypatch,
                                                                       kernels):
    """Greedy, sampled, seeded, penalised and biased rows, logprobs, prefills beside decodes,
    swaps and prefix hits (tests/test_device_discipline.py's workload), in float64: the
    engine that packs every step's inputs into one buffer, as on a device, gives the tokens
    of the one that does not, and each step that computes sends one upload. With the CPU
    kernels off, the sampler's torch path (the one CUDA takes) reads the staged subsets."""
    if kernels == "off":
        monkeypatch.setenv(ENV_SWITCH, "0")
    work = workload()
    settings = dict(dtype="float64", num_kv_blocks=60, max_num_seqs=32, swap_blocks=400,
                    preemption_mode="swap", max_num_batched_tokens=128)
    want = run(Engine(tiny_llama, **settings), work)

    sends: list[int] = []

    class PackedUpload(StepUpload):
        def __init__(self, device, *, pack=None):
            super().__init__(device, pack=True)

        def send(self):
            sends.append(len(self._parts))
            super().send()

    for module in (model_runner, torch_backend, metadata_module, sampler_module):
        monkeypatch.setattr(module, "StepUpload", PackedUpload)
    engine = Engine(tiny_llama, **settings)
    per_step: list[int] = []
    execute = engine.runner.execute

    def counted(out, *args, **kwargs):
        before = len(sends)
        result = execute(out, *args, **kwargs)
        if out.chunks:
            per_step.append(len(sends) - before)
        return result

    monkeypatch.setattr(engine.runner, "execute", counted)
    got = run(engine, work)
    stats = engine.stats()
    assert stats["preemptions_swap"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert per_step and set(per_step) == {1}
    # Every step's layout: 5 arrays and the ids; a mixed sampling step adds the plan's
    # indices, the logits rows, the values, penalty tokens, bias and subsets.
    assert min(sends) >= 6 and max(sends) > 20
    assert got == want
