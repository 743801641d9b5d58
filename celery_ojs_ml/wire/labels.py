"""A job's own labels (OJS ML §7.3): what other jobs' affinity and anti-affinity rules name.

Every ML job carries:
- `job_type`: its Celery task name;
- `queue`: its logical queue;
- the labels its task declares with the `ml_labels={...}` task option, or a
  call with `headers={"ojs_labels": {...}}` (the call's win).

They travel in the `ojs_labels` header; the gate gives them to the allocator
(so a worker's running jobs are matched against anti-affinity rules) and the
fleet scheduler reads them from pending records and leases.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress
from typing import Any

from celery_ojs_ml.errors import SpecError, Violation
from celery_ojs_ml.wire import headers as h

HEADER_LABELS = h.LABELS
MAX_LABELS = 32
MAX_LABEL_LEN = 253
_FIX = 'ml_labels={"app": "llm-serve"}: at most 32 labels, string keys and values of 1-253 chars'


def declared_labels(value: Any, attribute: str = "ml_labels") -> dict[str, str]:
    """Validate declared labels; SpecError naming `attribute` when they are not str -> str."""
    if value is None:
        return {}
    ok = isinstance(value, Mapping) and len(value) <= MAX_LABELS
    ok = ok and all(
        isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= MAX_LABEL_LEN
        and len(v) <= MAX_LABEL_LEN
        for k, v in value.items()
    )  # fmt: skip
    if not ok:
        problem = f"is {value!r}, not a mapping of labels"
        raise SpecError(Violation(attribute, problem, "OJS ML §7.3", _FIX))
    return dict(value)


def job_labels(task: Any, headers: Mapping[str, Any]) -> dict[str, str]:
    """The labels a running or waiting job shows other jobs' rules (never raises)."""
    out: dict[str, str] = {}
    if isinstance(task, str) and task:
        out["job_type"] = task
    queue = headers.get(h.LOGICAL)
    if isinstance(queue, str) and queue:
        out["queue"] = queue
    with suppress(SpecError):  # the router refuses such labels; a forged header is ignored
        out.update(declared_labels(headers.get(HEADER_LABELS), HEADER_LABELS))
    return out
