"""Paged attention in place (worker/attention/paged_*.py): the torch reference of the paged
interface against attention written out by hand, and the Triton kernel against the
reference, on CUDA where there is one, else under Triton's interpreter on the CPU
(conftest.py sets TRITON_INTERPRET=1 there). The engine through the "paged" backend is
compared with transformers in tests/test_engine_exactness.py and tests/test_model_forward.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from worker.attention import get_attention_backend
from worker.attention.paged_backend import PagedAttention
from worker.attention.paged_reference import paged_attention as reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Past every real block: a table entry there would fail any read of it.
FAR_BLOCK = 1 << 30


@dataclass
class Case:
    """One step's paged inputs, and the K/V of each sequence in position order."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    query_lens: list[int]


def make_case(heads: int, kv_heads: int, head_dim: int, block_size: int,
              query_lens: list[int], seq_lens: list[int], dtype: torch.dtype,
              seed: int = 0) -> Case:
    """Sequences in shuffled blocks of a cache that is NaN wherever no sequence wrote; table
    rows padded with a block id no cache has."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    free = list(range(sum(blocks) + 3))
    rng.shuffle(free)
    shape = (len(free), block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables, keys, values = [], [], []
    for n, seq_len in zip(blocks, seq_lens, strict=True):
        table = [free.pop() for _ in range(n)]
        k = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(seq_len):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        tables.append(table)
        keys.append(k)
        values.append(v)
    width = max(blocks)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return Case(
        q=torch.randn(starts[-1], heads, head_dim, generator=gen).to(dtype),
        k_cache=k_cache, v_cache=v_cache,
        block_tables=torch.tensor([t + [FAR_BLOCK] * (width - len(t)) for t in tables]),
        query_start_loc=torch.tensor(starts), seq_lens=torch.tensor(seq_lens),
        keys=keys, values=values, query_lens=list(query_lens))


def by_hand(case: Case, scale: float) -> torch.Tensor:
    """Causal grouped-query attention written out, in float64, one sequence at a time."""
    heads, kv_heads = case.q.shape[1], case.k_cache.shape[2]
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    starts = case.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        rows = slice(starts[b], starts[b + 1])
        q = case.q[rows].double()
        seq_len, q_len = k.shape[0], q.shape[0]
        k = k.double().repeat_interleave(heads // kv_heads, dim=1)  # query head h: h // groups
        v = v.double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        query_pos = torch.arange(seq_len - q_len, seq_len)
        scores[:, torch.arange(seq_len)[None, :] > query_pos[:, None]] = float("-inf")
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def run(kernel, case: Case, scale: float, device: str = "cpu") -> torch.Tensor:
    """``kernel`` over ``case`` on ``device``; rows no sequence owns stay NaN."""
    moved = [t.to(device) for t in (case.q, case.k_cache, case.v_cache, case.block_tables,
                                     case.query_start_loc, case.seq_lens)]
    out = torch.full_like(moved[0], float("nan"))
    kernel(*moved, scale, max(case.query_lens), out)
    return out.cpu()


# (heads, kv heads, head dim, block size, query lens, seq lens): decodes, a first chunk, a
# chunk after cached context (a prefix hit), one longer than a query tile, a sequence with
# no query rows (skipped), multi-head, grouped and multi-query heads, a head dim and a
# group that are no power of two.
CASES = {
    "gqa-mixed": (4, 2, 16, 16, [1, 7, 1, 40, 3, 0], [5, 7, 33, 70, 100, 12]),
    "mqa-decodes": (8, 1, 32, 8, [1, 1, 1, 1], [9, 1, 64, 100]),
    "mha-long-chunk": (2, 2, 16, 4, [90, 1], [130, 3]),
    "odd-shapes": (12, 4, 24, 4, [30, 1, 9], [30, 50, 20]),
}


@pytest.mark.parametrize("case_name", list(CASES))
def test_the_reference_attends_through_the_tables_as_written_out(case_name):
    heads, kv_heads, head_dim, block_size, q_lens, seq_lens = CASES[case_name]
    case = make_case(heads, kv_heads, head_dim, block_size, q_lens, seq_lens, torch.float64)
    got = run(reference, case, 0.3)
    assert not got.isnan().any()  # every row owned, no NaN slot read
    torch.testing.assert_close(got, by_hand(case, 0.3), atol=1e-12, rtol=0)


def triton_kernel():
    """The Triton kernel, or a skip (a failure under CI=true, where setup installs triton)."""
    if importlib.util.find_spec("triton") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no triton (CI=true: the dev extra installs it on Linux x86-64)")
        pytest.skip("triton is not installed (the dev extra has it on Linux x86-64)")
    from worker.attention.paged_triton import paged_attention

    return paged_attention


# The interpreter multiplies bfloat16 tiles wrongly (their bits as numbers), so bfloat16 is
# compared on a GPU only (tests/gpu); float16 takes the kernel's same reduced-precision path.
DTYPES = {"float32": (torch.float32, 2e-6), "float16": (torch.float16, 2e-3),
          "float64": (torch.float64, 1e-12)}
if DEVICE == "cuda":
    DTYPES = {"float32": (torch.float32, 2e-6), "bfloat16": (torch.bfloat16, 2e-2)}


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case_name", list(CASES))
def test_the_triton_kernel_equals_the_reference(case_name, dtype_name):
    kernel = triton_kernel()
    dtype, atol = DTYPES[dtype_name]
    heads, kv_heads, head_dim, block_size, q_lens, seq_lens = CASES[case_name]
    case = make_case(heads, kv_heads, head_dim, block_size, q_lens, seq_lens, dtype, seed=1)
    want = run(reference, case, head_dim**-0.5)
    got = run(kernel, case, head_dim**-0.5, DEVICE)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=0)


def test_a_padded_row_attends_to_nothing():
    """A padded decode batch (as a captured graph replays it): a row past the real ones
    belongs to a sequence of no length, which reads no block and comes out zero."""
    case = make_case(4, 2, 16, 16, [1, 1, 1], [5, 20, 1], torch.float32)
    case.seq_lens = torch.tensor([5, 20, 0])
    case.block_tables[2] = FAR_BLOCK
    want = run(reference, case, 0.25)
    assert not want[:2].isnan().any() and (want[2] == 0).all()
    torch.testing.assert_close(run(triton_kernel(), case, 0.25, DEVICE), want, atol=2e-6,
                               rtol=0)


def test_the_paged_backend_is_found_by_name():
    assert get_attention_backend("paged") is PagedAttention
    with pytest.raises(ValueError, match="3 query heads cannot be grouped over 2"):
        PagedAttention(3, 2, 16, 0.25)


def test_prefix_hits_and_swaps_through_the_paged_backend_keep_the_tokens(tiny_llama):
    """Requests that share a prompt's first blocks (prefix hits: a first chunk with cached
    context) in a pool too small for them (KV swapped out and back): the paged backend's
    greedy and seeded tokens equal the gathering torch backend's, in float64."""
    from worker import Engine, SamplingParams

    shared = list(range(2, 50))
    work = [shared + [100 + i] * (i + 1) for i in range(16)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                             seed=i) for i in range(16)]
    settings = dict(dtype="float64", num_kv_blocks=40, block_size=8, swap_blocks=400,
                    preemption_mode="swap", max_num_batched_tokens=128)
    paged = Engine(tiny_llama, attention_backend="paged", **settings)
    got = paged.generate(work, params)
    stats = paged.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["preemptions_swap"] > 0 and stats["swapped_in_blocks"] > 0
    want = Engine(tiny_llama, attention_backend="torch", **settings).generate(work, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_auto_picks_the_paged_backend_on_cuda_where_triton_is():
    from worker.attention import auto_backend

    assert auto_backend("cpu") == "torch"  # the CPU keeps its decode kernel
    want = "paged" if importlib.util.find_spec("triton") is not None else "torch"
    assert auto_backend("cuda") == want


def test_decode_graphs_are_wanted_on_cuda_with_the_paged_backend_unless_eager(tiny_llama):
    """Which engines capture (decided before the pool is sized: the graphs' memory is left
    them), and the batch sizes a capture covers."""
    from worker.engine.config import EngineConfig
    from worker.engine.memory import decode_graph_rows, gather_share
    from worker.models import load_model
    from worker.models.decode_graphs import MAX_GRAPH_BATCH, batch_buckets

    paged = load_model(tiny_llama, attention_backend="paged")
    gathering = load_model(tiny_llama, attention_backend="torch")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    config = EngineConfig(max_num_seqs=300)
    assert decode_graph_rows(config, cuda, paged) == MAX_GRAPH_BATCH == 256
    assert decode_graph_rows(EngineConfig(max_num_seqs=48), cuda, paged) == 48
    assert decode_graph_rows(EngineConfig(enforce_eager=True), cuda, paged) == 0
    assert decode_graph_rows(config, cuda, gathering) == 0
    assert decode_graph_rows(config, cpu, paged) == 0
    assert decode_graph_rows(config, cuda, None) == 0  # a simulated engine
    assert gather_share(paged, 2) == 0 and gather_share(gathering, 2) == 0.75
    assert batch_buckets(256)[:6] == [1, 2, 4, 8, 16, 32] and batch_buckets(256)[-1] == 256
    assert batch_buckets(3) == [1, 2, 3] and batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]


# (dtype, heads, kv heads, head dim, longest query): the 8b and 1b presets' shapes in
# bfloat16, decode and prefill; the tiny preset's in float32, float16 and float64.
TARGET_SHAPES = {
    "8b-bf16-decode": (torch.bfloat16, 32, 8, 128, 1),
    "8b-bf16-prefill": (torch.bfloat16, 32, 8, 128, 2048),
    "1b-bf16-decode": (torch.bfloat16, 32, 8, 64, 1),
    "tiny-fp32-decode": (torch.float32, 4, 2, 16, 1),
    "tiny-fp32-prefill": (torch.float32, 4, 2, 16, 64),
    "tiny-fp16-prefill": (torch.float16, 4, 2, 16, 64),
    "tiny-fp64-decode": (torch.float64, 4, 2, 16, 1),
}


def compile_for_hopper(shape: str) -> tuple[int, int]:
    """The kernel compiled for sm_90 with the constants a launch of ``shape`` would pass:
    (bytes of machine code, bytes of shared memory). Run where TRITON_INTERPRET is unset:
    under the interpreter a second compile in one process fails."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from worker.attention import paged_triton

    dtype, heads, kv_heads, head_dim, longest = TARGET_SHAPES[shape]
    kernel = paged_triton._paged_attention_kernel
    element = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
               torch.float64: "*fp64"}[dtype]
    types = {"q_ptr": element, "k_ptr": element, "v_ptr": element, "out_ptr": element,
             "tables_ptr": "*i64", "starts_ptr": "*i64", "lens_ptr": "*i64", "scale": "fp32"}
    constants = paged_triton.launch_constants(dtype, heads, kv_heads, head_dim, 16, longest)
    signature = {name: types.get(name, "i32" if name.startswith("stride") else "constexpr")
                 for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32))
    return len(compiled.asm["cubin"]), compiled.metadata.shared


def test_the_triton_kernel_compiles_for_a_hopper_gpu():
    """Compiled to machine code for sm_90 (an H100's or H200's) with the ptxas Triton
    carries, no GPU needed: what the interpreter never checks (tl.dot's tile and dtype
    rules, loop-carried types, shared memory) is checked here, for each shape's constants
    as the launch would pass them."""
    triton_kernel()
    script = ("import json, sys; sys.path.insert(0, 'tests'); import test_paged_attention as t; "
              "print(json.dumps({s: t.compile_for_hopper(s) for s in t.TARGET_SHAPES}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=600, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(compiled) == set(TARGET_SHAPES)
    for shape, (code, shared) in compiled.items():
        assert code > 0, shape  # machine code, not just PTX
        assert shared <= 227 * 1024, shape  # what a Hopper SM gives one block at most


def test_a_capture_that_fails_leaves_the_engine_eager_and_says_why(tiny_llama,
                                                                   monkeypatch):
    """An engine whose capture raises (here an engine told to capture on the CPU, which has
    no CUDA to capture with) starts without graphs, with a warning naming the error, and
    serves every step eagerly."""
    from structlog.testing import capture_logs

    from worker import Engine, SamplingParams
    from worker.engine import memory

    monkeypatch.setattr(memory, "decode_graph_rows", lambda config, device, model: 4)
    with capture_logs() as logs:
        engine = Engine(tiny_llama, attention_backend="paged")
    [warning] = [e for e in logs if e["log_level"] == "warning"]
    assert "run eagerly" in warning["event"] and "cuda" in warning["error"].lower()
    assert engine.runner.graphs is None and "cuda_graph_buckets" not in engine.stats()
    [done] = engine.generate([[5, 6, 7]], [SamplingParams(max_tokens=6, ignore_eos=True)])
    assert len(done.token_ids) == 6


# Ops that read a device's values back to the host (or size their output by them): any of
# them in a captured region fails the capture, or bakes one step's values into every replay.
HOST_READS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::is_nonzero",
              "aten::equal", "aten::masked_select", "aten::unique_dim", "aten::_unique2",
              "aten::repeat_interleave", "aten::tolist"}


def test_the_captured_decode_step_reads_nothing_back_to_the_host(tiny_llama, monkeypatch):
    """Every op of the decode step a graph captures (embedding, rope, norms, projections,
    the K/V write, the LM head), recorded as torch dispatches it on the CPU: none reads a
    value back to the host. (The attention kernel's launch is sized by host ints alone; a
    stub stands for it here, where the CPU would run the reference, which does read.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvstore.kv_tensors import PagedKVCache
    from worker.attention import paged_backend
    from worker.models import load_model
    from worker.models.decode_graphs import DecodeGraphs

    calls: list[str] = []

    def kernel_stub(q, k_cache, v_cache, block_tables, starts, seq_lens, scale, longest, out):
        calls.append(type(longest).__name__)
        return out.zero_()

    monkeypatch.setattr(paged_backend, "paged_kernel", lambda device: kernel_stub)
    model = load_model(tiny_llama, attention_backend="paged")
    c = model.config
    cache = PagedKVCache(c.num_hidden_layers, 8, 16, c.num_key_value_heads, c.head_dim,
                         torch.float32, spare_blocks=1)
    graphs = DecodeGraphs(model, cache, torch.device("cpu"), max_batch=4, max_model_len=64,
                          capture=False)
    seen: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func._schema.name)
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Record():
        logits = graphs._forward(4)
    assert logits.shape == (4, c.vocab_size)
    assert calls == ["int"] * c.num_hidden_layers  # the launch's size: a host int
    assert {"aten::index_copy_", "aten::mm", "aten::embedding"} <= seen  # it ran through
    assert not seen & HOST_READS, sorted(seen & HOST_READS)
