"""Workers that left the fleet, remembered a while so that the scheduler's DENY waits for them.

Responsibility: with `ojs_ml_deny_unsatisfiable`, a waiting job that no worker can
run any more (its only capable workers left after it was published) is denied (Flux
RFC 27 DENY) once those workers have been gone `ojs_ml_deny_after_s`, instead of
waiting for ever. The policy core already holds the rule: a job that no available
worker could ever run is denied unless a worker that is briefly away could
(`scheduler.core.Planner._unplaceable`). This collaborator supplies the away
workers: each worker that left the live set stays in the pass's fleet, unavailable,
for `deny_after_s`, and comes back as itself the moment it is live again.

Key decision: a new leader knows nothing of the workers that left before it led, so it
denies nothing until it has led `deny_after_s` itself (RFC 27 `hello` rebuilds
allocations, not history). A denial is therefore never earlier than `deny_after_s`
after the last capable worker left, whichever leader makes it. Without
`ojs_ml_deny_unsatisfiable` nothing is remembered and jobs wait (OJS ML §7.2).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from celery_ojs_ml.capabilities import parse_capabilities
from celery_ojs_ml.scheduler import Denial, Policy, WorkerState

log = logging.getLogger(__name__)


class Departed:
    """The live workers of the last reads, and those that left within `after_s`."""

    def __init__(self, enabled: bool, after_s: float) -> None:
        self.enabled = enabled
        self.after_s = after_s
        self._since: float | None = None
        """When this leadership began observing the fleet; None: not yet."""
        self._live: dict[str, Mapping[str, Any]] = {}
        self._gone: dict[str, tuple[float, WorkerState]] = {}
        """Worker -> (when it left, its away state)."""

    def hello(self) -> None:
        """A new leadership: forget everything (see the module doc)."""
        self._since = None
        self._live, self._gone = {}, {}

    def observe(self, live: Mapping[str, Mapping[str, Any]], now: float) -> list[WorkerState]:
        """Note which workers left since the last reads; the away ones within `after_s`."""
        if not self.enabled:
            return []
        if self._since is None:
            self._since = now
        for name, entry in self._live.items():
            if name not in live and name not in self._gone:
                away = _away(name, entry)
                if away is not None:
                    self._gone[name] = (now, away)
                    log.info("ojs-ml: worker %s left; jobs only it can run wait for it", name)
        self._live = dict(live)
        self._gone = {
            n: (at, state)
            for n, (at, state) in self._gone.items()
            if n not in live and now - at < self.after_s
        }
        return [state for _, state in self._gone.values()]

    def policy(self, policy: Policy, now: float) -> Policy:
        """The pass's policy, denying once this leadership has observed `after_s`."""
        ready = self.enabled and self._since is not None and now - self._since >= self.after_s
        return replace(policy, deny_unsatisfiable=ready) if ready else policy

    def note(self, denial: Denial) -> str:
        """The RFC 27 DENY note a denied job fails with (a reservation's denial says why
        itself)."""
        if not denial.unplaceable:
            return denial.note
        return (
            f"RFC 27 DENY: no worker that can run it has been live for {self.after_s:g} s "
            f"(ojs_ml_deny_after_s): {denial.note}"
        )


def _away(name: str, entry: Mapping[str, Any]) -> WorkerState | None:
    """A departed worker as the core's unavailable `WorkerState`; None when its last
    advertisement does not parse (it cannot have run anything the fleet lost)."""
    try:
        caps = parse_capabilities(entry["capabilities"], worker_id=name)
    except Exception as exc:
        log.debug("ojs-ml: departed worker %s: %s", name, exc)
        return None
    queues = (entry.get("info") or {}).get("queues")
    consumed = frozenset(queues) if queues else frozenset({"celery"})
    return WorkerState.of(name, caps, queues=consumed, available=False)
