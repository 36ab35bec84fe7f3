"""Keep the cyclic garbage collector off the objects a worker holds for its whole life.

After torch, transformers and the model are loaded a worker process holds ~300,000
objects that the collector tracks (functions, modules, dicts). Python runs a full
collection whenever the objects that survived into its oldest generation grew by a quarter,
and a full collection walks all of them with the GIL held, so every thread of the worker
(the engine loop between steps, the publisher) stalls that long (docs/cpu-kernels.md). Requests
make such survivors all the time (their state lives for thousands of steps), so a serving
worker would meet that stall again and again. ``gc.freeze()`` moves everything alive now
into a generation the collector never walks; what the worker makes later is still collected.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_long_lived_objects() -> int:
    """Collect what is garbage now, then exempt every object still alive from later
    collections; returns how many objects were frozen. For a process that is the worker's
    own (its entry point), once its engine is built: frozen objects that later become
    garbage in a reference cycle are never freed."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextmanager
def long_lived_frozen() -> Iterator[int]:
    """``freeze_long_lived_objects()`` for a while (an in-process engine that serves as a
    worker would, e.g. the benchmark's offline run); the objects go back to the collector's
    oldest generation afterwards."""
    try:
        yield freeze_long_lived_objects()
    finally:
        gc.unfreeze()
