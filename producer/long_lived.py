"""Keep the cyclic garbage collector off the objects a long-running process holds for its
whole life (a worker, a gateway).

After torch, transformers and the model are loaded a worker process holds ~300,000
objects that the collector tracks (functions, modules, dicts). Python runs a full
collection whenever the objects that survived into its oldest generation grew by a quarter,
and a full collection walks all of them with the GIL held, so every thread of the worker
(the engine loop between steps, the publisher) stalls that long (docs/cpu-kernels.md). Requests
make such survivors all the time (their state lives for thousands of steps), so a serving
worker would meet that stall again and again. ``gc.freeze()`` moves everything alive now
into a generation the collector never walks; what the worker makes later is still collected.

The youngest generation is collected once YOUNG_OBJECTS more objects were made than freed,
not Python's 700: at a GPU's step rate the engine loop makes and drops several hundred
per step (outputs, chunks, lists of ids), and with 700 a pass ran every step or two and
walked a step's worth of objects still in use: a W7 run spent ~5% of its wall time in the
collector, with pauses of up to ~8 ms (docs/benchmarks.md). Nearly all of them die young
by reference counting, so with YOUNG_OBJECTS few passes run at all; cycles are still
collected, a little later.

A gateway answering a thousand streams is the same case: each stream's generators, futures
and buffers live for its whole answer, and every chunk makes and drops a few dozen objects
(the XREAD reply, the event, its JSON). With Python's thresholds the collector took ~15% of
its CPU at 1,000 streams (docs/benchmarks.md), in passes that walked every open stream.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_OBJECTS = 20_000


def freeze_long_lived_objects() -> int:
    """Collect what is garbage now, then exempt every object still alive from later
    collections, and collect the youngest generation once YOUNG_OBJECTS more were made
    than freed; returns how many objects were frozen. For a process of its own (a worker's
    entry point once its engine is built, a gateway's before it serves): frozen objects
    that later become garbage in a reference cycle are never freed."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS, older, oldest)
    return gc.get_freeze_count()


@contextmanager
def long_lived_frozen() -> Iterator[int]:
    """``freeze_long_lived_objects()`` for a while (an in-process engine that serves as a
    worker would, e.g. the benchmark's offline run); the objects go back to the collector's
    oldest generation afterwards, and the thresholds are Python's again."""
    thresholds = gc.get_threshold()
    try:
        yield freeze_long_lived_objects()
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
