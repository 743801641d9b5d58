"""Process-wide worker setup: capabilities, the pool's kind, and the pool children's policy.

Key decision: CUDA binds `CUDA_VISIBLE_DEVICES` when a process first initialises
it, so on a GPU prefork worker no child reuses CUDA bound to other devices: it is
retired after a task that loaded the driver, runs one task, or (warm mode) is bound
to its device set (`ojs_ml_recycle_gpu_children`, `configure_child_recycling`). The
main process decides the policy before the pool forks and sets it in the child's
state through `PoolChildren`, which `plugin.py` hands over (`child.hooks`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from celery_ojs_ml.capabilities import Capabilities, resolve_capabilities
from celery_ojs_ml.capabilities.probe import advertised_peers, advertised_tokens, visible_tokens
from celery_ojs_ml.capabilities.profiles import is_probed
from celery_ojs_ml.celery_internals import (
    active_request_ids,
    missing_internals,
)
from celery_ojs_ml.celery_internals import pool_processes as pool_processes
from celery_ojs_ml.celery_internals import task_events_on as task_events_on
from celery_ojs_ml.lru import LRU
from celery_ojs_ml.worker.warm_pool import SlotTable

log = logging.getLogger("celery_ojs_ml.worker.core")
_CAPS_CACHE: LRU[str | None, Capabilities] = LRU(16)


class PoolChildren(Protocol):
    """The pool children's process state, as the main process sets it before the fork
    (`child.hooks.PoolChildren`)."""

    no_limit_kb: int

    def mode(self) -> str: ...

    def set_mode(self, mode: str) -> None: ...

    def set_visible(self, tokens: list[str] | None) -> None: ...

    def make_table(self) -> None: ...

    def table(self) -> SlotTable | None: ...

    def can_retire(self) -> bool: ...


def capabilities_for(value: str | None) -> Capabilities:
    """Resolve `--ojs-ml-capabilities` once per process (the probe is not free)."""
    caps = _CAPS_CACHE.get(value)
    if caps is None:
        caps = _CAPS_CACHE[value] = resolve_capabilities(value)
    return caps


def nvlink_peers_for(value: str | None, caps: Capabilities) -> list[frozenset[int]] | None:
    """The NVLink peers of each allocation index, for a probed worker whose GPUs have NVLink
    (`probe.advertised_peers`); None for declared capabilities (any set is linked)."""
    if not is_probed(value) or caps.gpu is None or caps.gpu.interconnect != "nvlink":
        return None
    return advertised_peers()


def plain_running(allocations: Iterable[Mapping[str, Any]]) -> int:
    """Tasks running in this worker's pool that are not ML jobs (not among the
    allocator's `allocations`, as its snapshot lists them): each holds a pool process
    the fleet scheduler would otherwise count free (`fleet_view.processes_free`).
    Celery 5.7's `celery.worker.state.active_requests`
    holds a request from its acceptance by a pool process to its end;
    `test_processes.py` in tests/integration fails if that changes."""
    found = active_request_ids()
    if found is None:  # a Celery without it: count nothing, as before
        return 0
    ml_ids = {a.get("task_id") for a in allocations}
    return sum(1 for task_id in found if task_id is not None and task_id not in ml_ids)


def hard_time_limit(timelimit: Any, task: Any = None, conf: Any = None) -> float | None:
    """The hard run-time limit Celery 5.7 enforces on a task, in seconds, or None: the
    message's `timelimit` header (`[hard, soft]`; ext_ml_timeout_seconds is written
    there at publish), else the task's `time_limit`, else `task_time_limit`. A soft
    limit alone is not an end (a task may catch `SoftTimeLimitExceeded` and go on), so
    it is not returned. The fleet scheduler estimates ends and backfill from it."""
    hard = timelimit[0] if isinstance(timelimit, list | tuple) and timelimit else None
    for found in (hard, getattr(task, "time_limit", None), getattr(conf, "task_time_limit", None)):
        if isinstance(found, int | float) and not isinstance(found, bool) and found > 0:
            return float(found)
    return None


def is_prefork(pool: Any) -> bool:
    """Whether a pool (class, instance or name) is billiard's prefork pool."""
    if pool is None:
        return False
    if isinstance(pool, str):
        return pool in ("prefork", "processes")
    return "prefork" in (getattr(pool, "__module__", "") or "")


def configure_child_recycling(
    sender: Any = None,
    conf: Any = None,
    options: Any = None,
    instance: Any = None,
    *,
    children: PoolChildren,
    **_: Any,
) -> None:
    """`celeryd_init`: make sure no pool child reuses CUDA bound to other devices.

    CUDA binds `CUDA_VISIBLE_DEVICES` when a process first initialises it.
    `ojs_ml_recycle_gpu_children`:
    * "cuda" (default): a child is retired after any task that left the CUDA
      driver loaded in it (`child.pinning.install_cuda_retirement`); others are reused.
    * "always": `worker_max_tasks_per_child=1`, one task per child.
    * "never": children are reused; only safe when tasks never initialise CUDA.
    * "warm": a child is bound to its device set (`warm_pool`).
    """
    app = getattr(instance, "app", None) or getattr(sender, "app", None)
    options = options or {}
    plugin = getattr(app, "ojs_ml", None) if app is not None else None
    mode = plugin.settings.recycle_gpu_children if plugin is not None else "cuda"
    caps = capabilities_for(options.get("ojs_ml_capabilities"))
    pool = options.get("pool_cls") or (conf.worker_pool if conf is not None else None)
    children.set_mode("never")
    children.set_visible(_visible(options.get("ojs_ml_capabilities"), caps))
    if mode == "never" or not (caps.gpu_count and is_prefork(pool) and conf is not None):
        return
    mode = _usable_mode(mode, children)
    children.set_mode(mode)
    if mode == "warm":
        children.make_table()  # before the pool forks: children inherit it
    elif mode == "cuda":
        if not (options.get("max_memory_per_child") or conf.worker_max_memory_per_child):
            conf.worker_max_memory_per_child = children.no_limit_kb
    else:
        _one_task_per_child(options, conf)


def _visible(value: Any, caps: Capabilities) -> list[str] | None:
    """The devices the worker itself was given, read before the pool forks."""
    tokens = advertised_tokens() if is_probed(value) else visible_tokens()
    if tokens is not None and len(tokens) < caps.gpu_count:
        log.error(
            "ojs-ml: the worker has %d GPUs but CUDA_VISIBLE_DEVICES names %d; tasks on the "
            "others get no device. Start it with as many visible devices as it advertises",
            caps.gpu_count,
            len(tokens),
        )
    return tokens


def _usable_mode(mode: str, children: PoolChildren) -> str:
    """`mode`, or the next safer one where the Celery/billiard internals it needs changed."""
    if mode == "warm" and missing_internals():
        log.warning(
            "ojs-ml: warm children need celery internals that changed (%s); retiring CUDA "
            "children instead",
            missing_internals(),
        )
        mode = "cuda"
    if mode == "cuda" and not children.can_retire():
        log.warning("ojs-ml: this billiard cannot retire CUDA children; one task per child")
        mode = "always"
    return mode


def _one_task_per_child(options: Any, conf: Any) -> None:
    given = options.get("max_tasks_per_child") or conf.worker_max_tasks_per_child
    if given not in (None, 1):
        log.warning(
            "ojs-ml: worker_max_tasks_per_child=%s on a GPU worker; forcing 1 because "
            'ojs_ml_recycle_gpu_children="always"',
            given,
        )
    conf.worker_max_tasks_per_child = 1
