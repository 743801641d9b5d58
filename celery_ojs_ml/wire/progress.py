"""The progress record of a running task: its Celery state, its meta and its event.

The task body writes it (`child.progress.progress`, and the checkpoint helper on
each save), `celery ojs-ml status` and `explain` read it back from the result
backend, and the metrics exporter counts the events.

Key decisions:
* The state is `PROGRESS` with meta `{"step", "total", "metrics", "eta_s"}`, the
  celery-progress convention that Flower shows. The result backend already keeps
  it, so a report is one backend write and readers need no store record.
* The estimate is the rate since the run's first report. Its baseline lives on
  the request, which Celery makes anew for each execution, so a retried,
  re-published or resumed run starts its own; a step that goes backwards starts
  one too.
* Metric values are JSON numbers or strings. Anything else (NaN included) is
  rejected with the metric's name: the meta is stored as JSON.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

STATE = "PROGRESS"
"""The Celery state of a task that reported progress and has not finished."""
EVENT = "ojs-progress"
"""The event each report sends (when the worker sends task events)."""
META_KEYS = ("step", "total", "metrics", "eta_s")
"""The keys of the `PROGRESS` meta, in order."""
TASK, CHECKPOINT = "task", "checkpoint"
"""Who reported: the task body itself, or its checkpoint helper on a save."""

_BASELINE = "_ojs_progress"
"""The request attribute holding the run's `Baseline` (never a message header)."""
_EXAMPLE = "e.g. progress(self, 10, 100, loss=0.31)"


@dataclass(slots=True)
class Baseline:
    """The first report of a run (time and step), the last step and who reports."""

    at: float
    step: int
    last: int
    source: str


def check_step(step: Any, total: Any) -> tuple[int, int | None]:
    """`step` and `total` as ints; TypeError/ValueError naming the argument otherwise."""
    if not _is_int(step):
        raise TypeError(f"step is {_describe(step)}; pass a non-negative int, {_EXAMPLE}")
    if int(step) < 0:
        raise ValueError(f"step is {int(step)}; pass a non-negative int, {_EXAMPLE}")
    if total is None:
        return int(step), None
    if not _is_int(total):
        raise TypeError(
            f"total is {_describe(total)}; pass the number of steps as an int, {_EXAMPLE}, "
            "or total=None when it is unknown"
        )
    if int(total) < int(step):
        raise ValueError(
            f"total is {int(total)}, less than step {int(step)}; total counts every step of "
            f"the run, {_EXAMPLE}, or pass total=None when it is unknown"
        )
    return int(step), int(total)


def check_metrics(metrics: Mapping[str, Any]) -> dict[str, int | float | str]:
    """The metrics as JSON numbers and strings; TypeError naming the first bad one."""
    out: dict[str, int | float | str] = {}
    for name, value in metrics.items():
        if isinstance(value, str):
            out[name] = value
        elif _is_int(value):
            out[name] = int(value)
        elif isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
        else:
            raise TypeError(
                f"metrics[{name!r}] is {_describe(value)}; a metric is a finite JSON number "
                f"or a string, {_EXAMPLE} (a tensor: pass loss.item(); NaN: leave it out or "
                f'pass it as a string, e.g. loss="nan")'
            )
    return out


def estimate(base: Baseline, step: int, total: int | None, now: float) -> float | None:
    """Seconds left at the rate since the baseline; None until a rate is known."""
    if total is None:
        return None
    if step >= total:
        return 0.0
    done, spent = step - base.step, now - base.at
    if done <= 0 or spent <= 0:
        return None
    return round((total - step) * spent / done, 1)


def advance(
    request: Any,
    step: int,
    total: int | None,
    metrics: Mapping[str, int | float | str],
    now: float,
    source: str = TASK,
) -> dict[str, Any]:
    """The `PROGRESS` meta of a report at `now` (a monotonic clock), after moving the
    run's baseline on `request` (a new one on the first report or a step backwards)."""
    base = getattr(request, _BASELINE, None)
    if not isinstance(base, Baseline) or step < base.last:
        base = Baseline(at=now, step=step, last=step, source=source)
        setattr(request, _BASELINE, base)
    base.last = step
    if source == TASK:
        base.source = TASK
    eta = estimate(base, step, total, now)
    return {"step": step, "total": total, "metrics": dict(metrics), "eta_s": eta}


def reported_by_task(request: Any) -> bool:
    """Whether the task body itself reported progress in this run."""
    base = getattr(request, _BASELINE, None)
    return isinstance(base, Baseline) and base.source == TASK


def from_checkpoint(request: Any, fields: Mapping[str, Any], now: float) -> dict[str, Any] | None:
    """The meta a checkpoint save reports (its step, loss and numeric metrics), or None
    when the save has no step or the task reports its own progress (its steps may
    count something else, e.g. batches where the checkpoint counts epochs)."""
    step = fields.get("step")
    if not isinstance(step, Integral) or isinstance(step, bool) or step < 0:
        return None
    if reported_by_task(request):
        return None
    found = {"loss": fields.get("loss"), **dict(fields.get("metrics") or {})}
    metrics = {k: v for k, v in found.items() if isinstance(k, str) and _is_json_scalar(v)}
    return advance(request, int(step), None, check_metrics(metrics), now, CHECKPOINT)


def is_progress(state: Any, info: Any) -> bool:
    """Whether a result backend's (state, info) is a progress report."""
    return state == STATE and isinstance(info, Mapping) and _is_int(info.get("step"))


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_json_scalar(value: Any) -> bool:
    if isinstance(value, str) or _is_int(value):
        return True
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _describe(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{text} ({type(value).__name__})"
