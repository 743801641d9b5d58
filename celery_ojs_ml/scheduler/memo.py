"""What outlives a pass: capability keys, which capabilities can ever run a class, and
worker states derived from the fleet's (`derived`).

Key decision: all are keyed so a lookup is cheap on the next pass over the same
fleet: a worker's capabilities object by identity (the registry hands the same
object back while the advertisement is unchanged), the "ever" answer by
(requirement class, capability key). Both are bounded and simply cleared when full;
derived states are kept from the last pass only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching import MatchResult, match
from celery_ojs_ml.scheduler.model import PendingJob, WorkerState
from celery_ojs_ml.spec.resources import MLRequirements

MEMO_MAX = 50_000
"""Entries per table before it is cleared."""


class Memo:
    """What outlives a pass: capability keys, and which capabilities can ever run a class."""

    def __init__(self) -> None:
        self._keys: dict[tuple[int, bool], tuple[Capabilities, str]] = {}
        self._ever: dict[tuple[str, str], MatchResult] = {}
        self._derived: dict[int, tuple[WorkerState, WorkerState]] = {}

    def caps_key(self, caps: Capabilities, *, exact: bool) -> str:
        """A key equal for equal capabilities; the worker id counts only when `exact`."""
        hit = self._keys.get((id(caps), exact))
        if hit is not None and hit[0] is caps:
            return hit[1]
        key = caps.model_dump_json(exclude=None if exact else {"worker_id"})
        if len(self._keys) >= MEMO_MAX:
            self._keys.clear()
        self._keys[(id(caps), exact)] = (caps, key)  # holds caps, so its id is not reused
        return key

    def derived(
        self, fleet: Sequence[WorkerState], make: Callable[[WorkerState], WorkerState]
    ) -> list[WorkerState]:
        """`make` of each worker state, made once per state object (the leader hands the
        same one back while the worker is unchanged). Only the last call's are kept, so a
        changed worker's old state is let go."""
        old, kept, out = self._derived, {}, []
        for state in fleet:
            hit = old.get(id(state))
            made = hit[1] if hit is not None and hit[0] is state else make(state)
            kept[id(state)] = (state, made)  # holds state, so its id is not reused
            out.append(made)
        self._derived = kept
        return out

    def ever(self, job: PendingJob, caps_key: str, caps: Capabilities) -> MatchResult:
        """`match` with no free capacity: NEVER means this class can never run there."""
        key = (job.class_key, caps_key)
        hit = self._ever.get(key)
        if hit is None:
            if len(self._ever) >= MEMO_MAX:
                self._ever.clear()
            hit = self._ever[key] = match(job.req, caps)
        return hit


def names_worker(req: MLRequirements) -> bool:
    """Whether a hard constraint names the `worker_id` label (then workers are not grouped:
    capability keys count the worker id, `Memo.caps_key(exact=True)`)."""
    if req.ext_ml_node_selector and "worker_id" in req.ext_ml_node_selector:
        return True
    specs = (req.ext_ml_affinity, req.ext_ml_anti_affinity)
    return any(r.key == "worker_id" for s in specs if s for r in s.required)
