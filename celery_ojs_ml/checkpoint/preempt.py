"""The preemption flag a running task polls: a SIGUSR2 flag plus a Redis key (OJS ML §8.2).

Key decisions:
- The SIGUSR2 handler only sets a per-process flag (`install_child_handler`): the
  task looks at it between steps and yields at a safe point, never mid-checkpoint.
- The Redis key reaches a task that no signal can reach (another host, a threads
  pool, a controller outside the worker); its TTL, the grace period plus a margin,
  keeps a stale request from preempting the re-published copy much later.
- `Preempted` is a Celery `Ignore`: the task ends without a FAILURE state and
  the worker's main process decides how the job is re-published.

Layout: `<prefix>:{ml}:preempt:<task id>`  string  JSON {requested_at, grace_s}, PX TTL
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from celery.exceptions import Ignore

from celery_ojs_ml.store.registry import OJSStore

log = logging.getLogger(__name__)
SIGNAL = signal.SIGUSR2
TTL_MARGIN_S = 5.0
"""How long a Redis preemption request outlives its grace period."""


class _Flag:
    """The per-process flag; a plain attribute is safe to set from a signal handler."""

    requested = False


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _Flag.requested = True


def install_child_handler() -> bool:
    """Install the SIGUSR2 handler in this process (call from `worker_process_init`).

    Returns False, with a warning, where no handler can be installed (not the
    main thread); the task then still sees requests through the Redis key.

    Raising from the handler would interrupt the task at an arbitrary bytecode. SIGUSR1
    is billiard's soft time limit, so SIGUSR2 it is; its default action kills the
    process, hence the handler is installed in every pool child before any preemption
    can be signalled.
    """
    try:
        signal.signal(SIGNAL, _on_signal)
    except ValueError as exc:
        log.warning("ojs-ml: cannot install the SIGUSR2 preemption handler here: %s", exc)
        return False
    return True


def reset_flag() -> None:
    """Clear the flag before a task starts (call from `task_prerun`)."""
    _Flag.requested = False


def flag_set() -> bool:
    """Whether this process received SIGUSR2 since the last `reset_flag()`."""
    return _Flag.requested


def request_preemption(
    store: OJSStore,
    task_id: str,
    grace_s: float,
    *,
    ttl_s: float | None = None,
    clock: Callable[[], float] = time.time,
) -> None:
    """Ask the running task `task_id` to yield within `grace_s` seconds (Redis key with TTL)."""
    if grace_s < 0:
        raise ValueError(
            f"grace_s must be >= 0 seconds (ext_ml_preemption_grace_period_s, OJS ML §8.2), "
            f"e.g. grace_s=30, but got {grace_s!r}"
        )
    record = {"requested_at": clock(), "grace_s": grace_s}
    ttl_ms = max(1, round((ttl_s if ttl_s is not None else grace_s + TTL_MARGIN_S) * 1000))
    store.client.set(store.key("preempt", task_id), json.dumps(record), px=ttl_ms)


def clear_preemption(store: OJSStore, task_id: str) -> None:
    """Withdraw a preemption request, e.g. once the job has yielded or been re-published."""
    store.client.delete(store.key("preempt", task_id))


def preemption_requested(store: OJSStore, task_id: str) -> bool:
    """Whether a preemption request for `task_id` is pending in Redis."""
    return bool(store.client.exists(store.key("preempt", task_id)))


def preemption_request(store: OJSStore, task_id: str) -> dict[str, Any] | None:
    """The pending request (`requested_at`, `grace_s`) for `task_id`, or None."""
    raw = store.client.get(store.key("preempt", task_id))
    if raw is None:
        return None
    record: dict[str, Any] = json.loads(raw)
    return record


class Preempted(Ignore):  # type: ignore[misc]
    """The task yielded to a preemption request at a safe point (OJS ML §8.2)."""

    def __init__(self, task_id: str, epoch: int | None = None, sequence: int | None = None) -> None:
        self.task_id = task_id
        self.epoch = epoch
        self.sequence = sequence
        where = f"epoch {epoch}" if epoch is not None else "an unknown epoch"
        last = f"checkpoint {sequence}" if sequence is not None else "no checkpoint"
        super().__init__(f"{task_id} preempted after {where}; resumes from {last}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.task_id, self.epoch, self.sequence))


class LeaseLost(Ignore):  # type: ignore[misc]
    """Another worker took this job over; this copy must stop (DESIGN invariant 5).

    Raised by a checkpoint commit that finds the job's lease held under
    another token: the worker running this copy stalled past the lease TTL
    and the job was re-published. Like `Preempted` it is a Celery `Ignore`,
    so this copy ends without storing a result; its commit did not happen.
    """

    def __init__(self, task_id: str, sequence: int | None = None) -> None:
        self.task_id = task_id
        self.sequence = sequence
        super().__init__(
            f"{task_id}: another worker took this job over; checkpoint {sequence} was not "
            "committed and this copy stops"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.task_id, self.sequence))
