"""What prefetch makes of each worker, kept from pass to pass while the worker is unchanged.

Key decision: the fleet view hands the leader the same `WorkerState` object, and the
change feed the same heartbeat snapshot, until a worker changes (`leader.fleet_memo`),
so a worker's jobs shown without a lease (`ahead.shown_on`), its `ahead.room_on` entry
and its running task ids (`Prefetch._turning`) are made again only for a worker that
changed or got an assignment this pass. At 10,000 workers, remaking all three for
every worker took about 70 ms of each pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from celery_ojs_ml.matching import FreeCapacity
from celery_ojs_ml.scheduler import PendingJob, RunningJob, WorkerState

from . import ahead as rules

_NO_SNAPSHOT: Mapping[str, Any] = MappingProxyType({})
"""A worker with no heartbeat snapshot: one object, so that it is kept too."""


@dataclass(slots=True)
class _Kept:
    state: WorkerState
    snap: Mapping[str, Any]
    shown: list[RunningJob]
    room: tuple[int, int] | None = None
    roomed: bool = False
    ids: frozenset[str] | None = None


class AheadKept:
    """Per worker, what the last pass made of it (see module doc); `shown` starts a pass."""

    def __init__(self) -> None:
        self._by: dict[str, _Kept] = {}

    def shown(
        self, fleet: Sequence[WorkerState], live: Mapping[str, Mapping[str, Any]]
    ) -> dict[str, list[RunningJob]]:
        """`ahead.shown_running`, made again only for the workers that changed; it
        forgets the workers not in `fleet`."""
        by: dict[str, _Kept] = {}
        out: dict[str, list[RunningJob]] = {}
        for w in fleet:
            snap = (live.get(w.name) or {}).get("free") or _NO_SNAPSHOT
            kept = self._by.get(w.name)
            if kept is None or kept.state is not w or kept.snap is not snap:
                kept = _Kept(w, snap, rules.shown_on(w, snap))
            by[w.name] = kept
            if kept.shown:
                out[w.name] = kept.shown
        self._by = by
        return out

    def room(
        self,
        fleet: Sequence[WorkerState],
        left: Mapping[str, FreeCapacity],
        assigned: Mapping[str, list[PendingJob]],
    ) -> dict[str, tuple[int, int]]:
        """`ahead.room` with this pass's `shown`; a worker the pass assigned nothing to
        (its `left` is its own free capacity) keeps its entry."""
        out: dict[str, tuple[int, int]] = {}
        for w in fleet:
            kept, new, here = self._by[w.name], assigned.get(w.name), left[w.name]
            if new or here is not w.free:
                entry = rules.room_on(w, here, new or (), kept.shown)
            else:
                if not kept.roomed:
                    kept.room, kept.roomed = rules.room_on(w, here, (), kept.shown), True
                entry = kept.room
            if entry is not None:
                out[w.name] = entry
        return out

    def running_ids(self, w: WorkerState) -> frozenset[str]:
        """The task ids running on `w`: its leases' and those only its heartbeat shows."""
        kept = self._by[w.name]
        if kept.ids is None:
            kept.ids = frozenset(r.task_id for r in (*w.running, *kept.shown))
        return kept.ids
