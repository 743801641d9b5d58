"""Dynamic batching: a task's declaration, and the batch record the gate hands its child.

    @app.task(bind=True, ml={"ext_ml_gpu_count": 1}, ml_batch={"max_size": 32, "max_wait_ms": 5})
    def embed(self, requests): ...  # one call: a list of requests, a list of results

Key decisions:
* The declaration is a task option, read from the task object, as `ml` and
  `ml_dedup` are: the producer, the worker's main process and the pool child
  each read it from the same place, and a bad one fails when the app
  finalizes, naming the option and showing a correct one.
* The gate's batch record travels in the first request's headers (`h.BATCH`):
  one pool job carries the whole batch; each other request is one `member`
  record (its headers, arguments and Celery's embedded callbacks).

* Whether a task batches its requests is one rule (`batches_requests`): the
  worker's gate, its heartbeat (`info.batching`, the names of its tasks that
  batch) and the leader's prefetch (no job of such a task follows on) agree.

Record (`h.BATCH` header): `{"requests": [member, ...], "events": bool}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery_ojs_ml.errors import ConfigError

OPTION = "ml_batch"
MAX_SIZE = 1024
"""The largest `max_size` accepted (a batch is one pool job: its record is one pickle)."""
MAX_WAIT_MS = 10_000.0
DEFAULT_WAIT_MS = 5.0
REQUESTS, EVENTS = "requests", "events"
ADVERTISED = "batching"
"""The heartbeat `info` key listing the names of a worker's tasks that batch."""
_EXAMPLE = f'e.g. {OPTION}={{"max_size": 32, "max_wait_ms": 5}}'


@dataclass(frozen=True, slots=True)
class BatchOptions:
    """A task's `ml_batch` declaration."""

    max_size: int
    """The most requests one call receives (1 to `MAX_SIZE`)."""
    max_wait_s: float
    """How long a batch that is not full waits for more while its devices are free."""


def options_of(task: Any) -> BatchOptions | None:
    """The task's batching declaration, None when it has none; a bad one is a
    ConfigError naming the task, the option and the fix."""
    raw = getattr(task, OPTION, None)
    if raw is None:
        return None
    name = getattr(task, "name", "?")
    if not isinstance(raw, Mapping) or set(raw) - {"max_size", "max_wait_ms"}:
        raise ConfigError(
            f"task {name}: {OPTION}={raw!r}; use a mapping with the keys max_size and "
            f"max_wait_ms, {_EXAMPLE}"
        )
    size = raw.get("max_size")
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_SIZE:
        raise ConfigError(
            f"task {name}: {OPTION} max_size is {size!r}; use an int from 1 to {MAX_SIZE}, "
            f"{_EXAMPLE}"
        )
    wait = raw.get("max_wait_ms", DEFAULT_WAIT_MS)
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= MAX_WAIT_MS:
        raise ConfigError(
            f"task {name}: {OPTION} max_wait_ms is {wait!r}; use a number of milliseconds "
            f"from 0 to {MAX_WAIT_MS:g}, {_EXAMPLE}"
        )
    return BatchOptions(size, float(wait) / 1000.0)


def batching(options: BatchOptions | None) -> bool:
    """Whether a declaration batches requests: a `max_size` of 1 runs them one by one."""
    return options is not None and options.max_size >= 2


def batches_requests(task: Any) -> bool:
    """Whether a task batches its requests (`batching`); a bad declaration batches
    nothing (the worker refuses to start with it, and every call of it raises)."""
    try:
        return batching(options_of(task))
    except ConfigError:
        return False


def batching_tasks(tasks: Mapping[str, Any]) -> list[str]:
    """The sorted names of a task registry's tasks that batch their requests
    (`info.batching` in a worker's heartbeat)."""
    return sorted(name for name, task in list(tasks.items()) if batches_requests(task))


def advertises(info: Any, name: str) -> bool:
    """Whether a heartbeat's `info` lists task `name` as batching; a value of another
    shape (a foreign or corrupt heartbeat) lists none."""
    found = info.get(ADVERTISED) if isinstance(info, Mapping) else None
    return isinstance(found, list) and name in found


def batch_record(members: list[dict[str, Any]], events: bool) -> dict[str, Any]:
    """The `h.BATCH` header of a batch's first request."""
    return {REQUESTS: members, EVENTS: events}


def members_of(record: Any) -> tuple[list[dict[str, Any]], bool]:
    """(member records, whether to send their task events) of an `h.BATCH` header;
    ([], False) for a request that carries none."""
    if not isinstance(record, Mapping):
        return [], False
    found = record.get(REQUESTS)
    members = [m for m in found if isinstance(m, dict)] if isinstance(found, list) else []
    return members, bool(record.get(EVENTS))
