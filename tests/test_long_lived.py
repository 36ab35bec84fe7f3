"""A worker process exempts what it holds for good from the cyclic collector's full passes."""

from __future__ import annotations

import gc
import weakref

from producer.long_lived import YOUNG_OBJECTS, long_lived_frozen


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_objects_alive_are_frozen_and_later_garbage_is_still_collected():
    assert gc.get_freeze_count() == 0  # precondition: nothing frozen in this process yet
    kept = _Node()
    thresholds = gc.get_threshold()
    with long_lived_frozen() as frozen:
        assert frozen > 0
        assert gc.get_threshold() == (YOUNG_OBJECTS, *thresholds[1:])
        assert not any(o is kept for o in gc.get_objects())  # out of every generation
        later = _Node()
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None  # made after the freeze: collected as ever
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
    assert any(o is kept for o in gc.get_objects(2))  # back in the oldest generation
