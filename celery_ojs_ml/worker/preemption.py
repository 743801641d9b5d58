"""Priority preemption on one worker (OJS ML §8, DESIGN decision 5).

Key decision: cooperative first, then forced. The gate sets the victim's preemption
flag and arms a timer for its grace period; a task that checkpoints and raises
`Preempted` in time yields cleanly, one that does not is killed through the pool
(`Preemptions.hard_kill`), never by `revoke(terminate=True)`, which would blocklist
the task id and drop the re-published copy. Either way the same task id is
re-published once the child has finished (`Preemptions.requeue`). Victims are chosen
by `allocator.policy`; `ext_mlx_scheduling_preemption_policy` picks the path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

from billiard.exceptions import Terminated, WorkerLostError
from celery.exceptions import Ignore

from celery_ojs_ml.allocator import Allocator, with_preemption_limits
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.store.deadletter import republish_request
from celery_ojs_ml.wire.headers import BAND, LOGICAL, PREEMPTIONS
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker.stopping import UNSTARTED_S

log = logging.getLogger(__name__)
DEFAULT_GRACE_S = 30.0
HEADER_PREEMPTIONS = PREEMPTIONS
HEADER_POLICY = "ext_mlx_scheduling_preemption_policy"
IMMEDIATE = "immediate"


def policy_of(headers: dict[str, Any]) -> str | None:
    """The job's `ext_mlx_scheduling_preemption_policy` (OJS ML Extensions §7), if any."""
    value = headers.get(HEADER_POLICY)
    return value if isinstance(value, str) else None


def grace_of(req: Any) -> float:
    """The victim's grace period in seconds (§8.2, default 30; 0 when `immediate`)."""
    if policy_of(req.request_dict) == IMMEDIATE:
        return 0.0
    value = req.request_dict.get("ext_ml_preemption_grace_period_s")
    return float(value) if isinstance(value, int | float) else DEFAULT_GRACE_S


def preemptions_of(headers: dict[str, Any]) -> int:
    """How often this job has been preempted so far."""
    return int(headers.get(HEADER_PREEMPTIONS) or 0)


class Preemptions:
    """The preemptions one worker has in flight, keyed by the victim's Request.

    Victims: lowest band first, newest first, then pruned to a minimal set
    (`allocator.policy`); spot is always preemptible, on-demand only by reserved and
    only with `ojs_ml_allow_on_demand_preemption`. `ext_mlx_scheduling_preemption_policy`
    (OJS ML Extensions §7): `never` makes the job no victim at all (`cap`), `immediate`
    skips the flag and the grace period and kills the child at once, `save_and_retry`
    (the default) is the cooperative path. Either way the job is re-published as a
    preemption.
    """

    def __init__(
        self,
        app: Any,
        consumer: Any,
        settings: OJSMLSettings,
        allocator: Allocator,
        kill_child: Callable[[int | None], bool],
        prefork: bool,
    ) -> None:
        self.app, self.c, self.settings, self.allocator = app, consumer, settings, allocator
        self.kill_child, self.prefork = kill_child, prefork
        self.timers: dict[Any, Any] = {}
        self.forsake: Callable[[Any], None] = lambda req: None
        """Stops refreshing, releasing and acking a job's lease and message, so that they
        outlive this run (`Running.forsake`)."""

    def __contains__(self, req: Any) -> bool:
        return req in self.timers

    def cap(self, ml: MLRequirements, headers: dict[str, Any]) -> MLRequirements:
        """Not preemptible when its policy is `never` or past `ojs_ml_max_preemptions`."""
        return with_preemption_limits(
            ml,
            policy=policy_of(headers),
            preemptions=preemptions_of(headers),
            max_preemptions=self.settings.max_preemptions,
        )

    def make_room(self, ml: MLRequirements, band: str) -> float | None:
        """Preempt victims so a held higher-band job fits; the longest grace, or None."""
        victims = self.allocator.victims(ml, band)
        if not victims:
            return None
        longest = 0.0
        for alloc in victims:
            grace = grace_of(alloc.key)
            longest = max(longest, grace)
            if alloc.key not in self.timers:
                self.preempt(alloc.key, grace)
        return longest

    def preempt(self, req: Any, grace: float) -> None:
        """Set the flag, signal the child, and arm the hard kill for the end of the grace.

        The flag is a Redis key the checkpoint helper polls, plus SIGUSR2 to the pool
        child, whose handler only sets a flag; the grace is
        `ext_ml_preemption_grace_period_s` (default 30 s). An `immediate` job gets
        neither flag nor signal: the kill comes at once.
        """
        if policy_of(req.request_dict) == IMMEDIATE:
            log.warning("ojs-ml: preempting %s[%s] at once", req.name, req.id)
        else:
            log.warning("ojs-ml: preempting %s[%s] (grace %.1f s)", req.name, req.id, grace)
            self._ask_to_yield(req, grace)
        self.timers[req] = self.c.timer.call_after(grace, self.hard_kill, (req,))

    def _ask_to_yield(self, req: Any, grace: float) -> None:
        from celery_ojs_ml.checkpoint import request_preemption

        try:
            request_preemption(self.app.ojs_ml.store, req.id, grace)
        except Exception as exc:
            log.warning("ojs-ml: could not set the preemption flag of %s: %s", req.id, exc)
        pid = getattr(req, "worker_pid", None)
        if self.prefork and pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)

    def hard_kill(self, req: Any) -> None:
        """The grace period is over (or there is none) and the task has not yielded: stop it."""
        pid = getattr(req, "worker_pid", None)
        if req not in self.timers:
            return
        if not pid:  # dispatched, but no pool child has taken it yet: look again shortly
            self.timers[req] = self.c.timer.call_after(UNSTARTED_S, self.hard_kill, (req,))
            return
        if self.kill_child(pid):
            log.warning("ojs-ml: %s %s; killed pid %s", req.id, _kill_reason(req), pid)
        else:
            log.warning(
                "ojs-ml: %s ignored preemption; a non-prefork pool cannot stop one task", req.id
            )

    def finished(self, req: Any) -> None:
        """The victim ended (any way): disarm its timer."""
        timer = self.timers.pop(req, None)
        if timer is not None:
            timer.cancel()

    def yielded(self, req: Any, exc: BaseException) -> bool:
        """Whether `exc` is how a preempted job ends (Preempted, or killed after its grace).
        A `Preempted` this worker did not ask for counts too (the request came from another
        process, or was left over from an earlier copy): the job checkpointed and stopped,
        so it must be re-published, never dropped."""
        from celery_ojs_ml.checkpoint import Preempted

        if isinstance(exc, Preempted):
            return True
        return req in self.timers and isinstance(exc, Ignore | Terminated | WorkerLostError)

    def requeue(self, req: Any, exc: BaseException) -> None:
        """Re-publish the preempted job: same id, same retries, one more preemption.

        With the last committed checkpoint, once the child has finished (so the two runs
        never overlap) and before the lease is released. Flower sees `task-retried`
        (RETRY, not a sticky custom state); the detail goes out as `ojs-preempted`.
        """
        from celery.worker import state as worker_state

        from celery_ojs_ml.checkpoint import clear_preemption

        store = self.app.ojs_ml.store
        worker_state.task_ready(req)
        count = preemptions_of(req.request_dict) + 1
        try:
            clear_preemption(store, req.id)
            checkpoint = republish_request(self.app, store, req, ojs_preemptions=count)
        except Exception as err:  # the broker or the store is away: the lease holds the job
            log.warning(
                "ojs-ml: could not re-publish preempted %s (%s); its lease is kept, and the "
                "worker that claims it once it expires re-publishes the job",
                *(req.id, err),
            )
            self.forsake(req)
            return
        how = "yielded" if isinstance(exc, Ignore) else _killed(req)
        log.warning("ojs-ml: %s %s; re-published (preemption %d)", req.id, how, count)
        req.send_event("task-retried", exception=f"Preempted({how}, preemptions={count})")
        dispatcher = getattr(self.c, "event_dispatcher", None)
        if dispatcher is not None and dispatcher.enabled:
            dispatcher.send(
                "ojs-preempted",
                uuid=req.id,
                preemptions=count,
                how=how,
                checkpoint=(checkpoint or {}).get("sequence"),
                band=req.request_dict.get(BAND),
                queue=req.request_dict.get(LOGICAL),
            )


def _kill_reason(req: Any) -> str:
    """Why a victim was killed, for the log."""
    if policy_of(req.request_dict) == IMMEDIATE:
        return f"is preempted at once ({HEADER_POLICY}: {IMMEDIATE})"
    return "did not yield within its grace period"


def _killed(req: Any) -> str:
    """How a killed victim ended, for the log and the `ojs-preempted` event's `how`."""
    if policy_of(req.request_dict) == IMMEDIATE:
        return "was killed at once"
    return "was killed after its grace period"
