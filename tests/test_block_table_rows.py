"""The runner's block tables kept across steps equal the scheduler's tables, step by step,
through admission, growth, preemption (swap and recompute), swap-in and finishing."""

from __future__ import annotations

import random

import pytest

from kvstore import BlockPool, KVCacheManager
from scheduler import Request, Scheduler, SchedulerConfig
from scheduler.output import ScheduledChunk, SchedulerOutput
from worker.engine.block_table_rows import BlockTableRows


def _chunk(rid: str, new: list[int], known: int) -> ScheduledChunk:
    return ScheduledChunk(rid, [1], 0, new, known, True, 0)


def test_rows_grow_in_place_and_are_reused_after_release():
    rows = BlockTableRows(num_rows=1, width=1)
    assert rows.apply(SchedulerOutput(chunks=[_chunk("a", [5, 6], 0)])) == [0]
    # b needs a second row: the tensor doubles; a gains a block: only the tail is written.
    assert rows.apply(SchedulerOutput(chunks=[_chunk("a", [7], 2), _chunk("b", [9], 0)])) \
        == [0, 1]
    assert rows.gather([0, 1], 3).tolist() == [[5, 6, 7], [9, 0, 0]]
    rows.apply(SchedulerOutput(finished_ids=["a"]))
    assert rows.apply(SchedulerOutput(chunks=[_chunk("c", [3], 0)])) == [0]
    assert rows.gather([0], 1).tolist() == [[3]]


def test_a_chunk_that_assumes_other_blocks_is_refused():
    rows = BlockTableRows()
    rows.apply(SchedulerOutput(chunks=[_chunk("a", [5, 6], 0)]))
    with pytest.raises(RuntimeError, match="assumes 1 blocks"):
        rows.apply(SchedulerOutput(chunks=[_chunk("a", [7], 1)]))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_rows_follow_the_scheduler_under_memory_pressure(mode):
    rng = random.Random(0)
    kv = KVCacheManager(BlockPool(40), 4, host_pool=BlockPool(200) if mode == "swap" else None,
                        watermark_blocks=1)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                      max_model_len=512, preemption_mode=mode), kv)
    for i in range(12):
        sched.add_request(Request(f"r{i}", [1] * rng.randint(3, 30), max_tokens=rng.randint(5, 40)))
    rows, preempted = BlockTableRows(num_rows=2, width=2), 0
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += len(out.preempted_ids)
        placed = rows.apply(out)
        for chunk, row in zip(out.chunks, placed, strict=True):
            table = kv.block_table(chunk.request_id)
            assert rows.gather([row], len(table)).tolist() == [table]
        sched.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
    assert preempted > 0  # the pressure really preempted
    rows.apply(sched.schedule())  # the last finishes reach the rows with the next step
    assert rows.rows == {}
