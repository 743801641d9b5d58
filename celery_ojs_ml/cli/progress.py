"""Running jobs' progress for `status` and `explain`: read back from the result backend.

Key decision: `progress(self, ...)` stores the `PROGRESS` state in the result
backend (`wire.progress`), so the CLI reads each running job's state there, one
read per running job, and nothing else records it. An app without a result
backend, or a backend that does not answer, shows no progress and no error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_ojs_ml.matching.filters import fmt
from celery_ojs_ml.wire import progress as wire

if TYPE_CHECKING:
    from celery_ojs_ml.plugin import OJSML


def progress_of(plugin: OJSML, task_id: str) -> dict[str, Any] | None:
    """The last progress a running task reported (`{step, total, metrics, eta_s}`), or None."""
    backend = plugin.app.backend
    if type(backend).__name__ == "DisabledBackend":
        return None
    try:
        meta = backend.get_task_meta(task_id, cache=False)
    except Exception:  # the backend is down: the rest of the report still stands
        return None
    info = meta.get("result")
    return dict(info) if wire.is_progress(meta.get("status"), info) else None


def attach(plugin: OJSML, workers: dict[str, dict[str, Any]]) -> None:
    """Add `progress` to each allocation of a task that reported some."""
    for view in workers.values():
        for alloc in view.get("allocations") or []:
            task_id = alloc.get("task_id")
            if isinstance(task_id, str):
                found = progress_of(plugin, task_id)
                if found is not None:
                    alloc["progress"] = found


def describe(found: dict[str, Any]) -> str:
    """`step 40/100 (40%), eta 12 s, loss=0.31` (the parts that are known)."""
    step, total, eta = found.get("step"), found.get("total"), found.get("eta_s")
    parts = [f"step {step}/{total}" if total is not None else f"step {step}"]
    if isinstance(total, int) and total > 0 and isinstance(step, int):
        parts[0] += f" ({100 * step // total}%)"
    if eta is not None:
        parts.append(f"eta {fmt(round(eta))} s")
    metrics = found.get("metrics") or {}
    if metrics:
        parts.append(" ".join(f"{k}={_short(v)}" for k, v in metrics.items()))
    return ", ".join(parts)


def lines(allocations: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(task id, description) of each allocation that reported progress."""
    return [
        (str(a.get("task_id")), describe(a["progress"]))
        for a in allocations
        if isinstance(a.get("progress"), dict)
    ]


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
