"""The cyclic garbage collector paused for one scheduling pass.

A pass over a large backlog allocates hundreds of thousands of small objects, almost all
freed by reference counting when the pass ends. CPython's generational collector, run
in the middle of it, walks them all: single decisions took 0.3-1.0 s instead of
microseconds (`bench/scheduler.py` at 10,000 workers and 100,000 jobs). The whole pass
runs paused, reads and fleet view too: paused only around the core, collections landed
in the fleet view (0.93 against 0.46 s at 10,000 workers) and the reads
(`bench/leader_pass.py`). Collecting the young generation after costs the same work
once, when no decision waits on it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector for the block; re-enable it (if it was on) after."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
            gc.collect(0)
