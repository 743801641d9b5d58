"""Process-wide worker setup: capabilities, the pool's kind and the pool children's hooks.

Split out of `worker` to keep modules small; `worker.install` connects the hooks.

Key decision: CUDA binds `CUDA_VISIBLE_DEVICES` when a process first initialises
it, so on a GPU prefork worker no child reuses CUDA bound to other devices: it is
retired after a task that loaded the driver, runs one task, or (warm mode) is bound
to its device set (`ojs_ml_recycle_gpu_children`, `configure_child_recycling`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from celery.states import SUCCESS
from celery.worker import state as worker_state

from celery_ojs_ml.capabilities import Capabilities, resolve_capabilities
from celery_ojs_ml.capabilities.probe import advertised_peers, advertised_tokens, visible_tokens
from celery_ojs_ml.capabilities.profiles import is_probed
from celery_ojs_ml.checkpoint.preempt import reset_flag
from celery_ojs_ml.child import pinning as child
from celery_ojs_ml.lru import LRU
from celery_ojs_ml.spec.flux_rules import is_int
from celery_ojs_ml.worker import warm_pool
from celery_ojs_ml.worker.gangs import is_rank, store_rank_result

log = logging.getLogger("celery_ojs_ml.worker.core")
_CAPS_CACHE: LRU[str | None, Capabilities] = LRU(16)


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


def task_events_on(consumer: Any) -> bool:
    """Whether this worker sends task events now: started with `-E` or
    `worker_send_task_events`, or switched on since by the `enable_events` control
    command (Flower sends it). Celery 5.7's consumer keeps an `EventDispatcher` whose
    `groups` is None (every group) or holds "task" then; with task events off it is
    {"worker"}, and it drops the worker's own `ojs-*` events too
    (`test_waiting_events_follow_the_workers_task_events_and_flowers_enable_events` in
    tests/integration/test_worker.py fails if that changes)."""
    dispatcher = getattr(consumer, "event_dispatcher", None)
    if dispatcher is None or not getattr(dispatcher, "enabled", False):
        return False
    groups = getattr(dispatcher, "groups", None)
    return groups is None or "task" in groups


def pool_processes(consumer: Any) -> int | None:
    """The processes (threads) of this worker's pool now, which the fleet scheduler
    counts (`fleet_view.processes_free`); None before the pool starts. Celery 5.7's
    `BasePool.num_processes` (prefork: billiard's `Pool._processes`, which
    `--autoscale` moves); `test_processes.py` in tests/integration fails if that
    changes."""
    try:
        found = consumer.pool.num_processes
    except Exception:  # no consumer or pool yet, or a pool that is not started
        return None
    return found if is_int(found) else None


def plain_running(allocations: Iterable[Mapping[str, Any]]) -> int:
    """Tasks running in this worker's pool that are not ML jobs (not among the
    allocator's `allocations`, as its snapshot lists them): each holds a pool process
    the fleet scheduler would otherwise count free (`fleet_view.processes_free`).
    Celery 5.7's `celery.worker.state.active_requests`
    holds a request from its acceptance by a pool process to its end;
    `test_processes.py` in tests/integration fails if that changes."""
    try:
        found = [getattr(r, "id", None) for r in list(worker_state.active_requests)]
    except Exception:  # a Celery without it: count nothing, as before
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
    **_: Any,
) -> None:
    """`celeryd_init`: make sure no pool child reuses CUDA bound to other devices.

    CUDA binds `CUDA_VISIBLE_DEVICES` when a process first initialises it.
    `ojs_ml_recycle_gpu_children`:
    * "cuda" (default): a child is retired after any task that left the CUDA
      driver loaded in it (`child.install_cuda_retirement`); others are reused.
    * "always": `worker_max_tasks_per_child=1`, one task per child.
    * "never": children are reused; only safe when tasks never initialise CUDA.
    """
    app = getattr(instance, "app", None) or getattr(sender, "app", None)
    options = options or {}
    plugin = getattr(app, "ojs_ml", None) if app is not None else None
    mode = plugin.settings.recycle_gpu_children if plugin is not None else "cuda"
    caps = capabilities_for(options.get("ojs_ml_capabilities"))
    pool = options.get("pool_cls") or (conf.worker_pool if conf is not None else None)
    child.RECYCLE["mode"] = "never"
    _read_visible(options.get("ojs_ml_capabilities"), caps)
    if mode == "never" or not (caps.gpu_count and is_prefork(pool) and conf is not None):
        return
    mode = child.RECYCLE["mode"] = _usable_mode(mode)
    if mode == "warm":
        warm_pool.make_table()  # before the pool forks: children inherit it
    elif mode == "cuda":
        if not (options.get("max_memory_per_child") or conf.worker_max_memory_per_child):
            conf.worker_max_memory_per_child = child.NO_LIMIT_KB
    else:
        _one_task_per_child(options, conf)


def _read_visible(value: Any, caps: Capabilities) -> None:
    """The devices the worker itself was given, before the pool forks (`child.VISIBLE`)."""
    child.VISIBLE["tokens"] = advertised_tokens() if is_probed(value) else visible_tokens()
    if child.VISIBLE["tokens"] is not None and len(child.VISIBLE["tokens"]) < caps.gpu_count:
        log.error(
            "ojs-ml: the worker has %d GPUs but CUDA_VISIBLE_DEVICES names %d; tasks on the "
            "others get no device. Start it with as many visible devices as it advertises",
            caps.gpu_count,
            len(child.VISIBLE["tokens"] or []),
        )


def _usable_mode(mode: str) -> str:
    """`mode`, or the next safer one where the Celery/billiard internals it needs changed."""
    if mode == "warm" and warm_pool.missing_internals():
        log.warning(
            "ojs-ml: warm children need celery internals that changed (%s); retiring CUDA "
            "children instead",
            warm_pool.missing_internals(),
        )
        mode = "cuda"
    if mode == "cuda" and not child.billiard_can_retire():
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


def _child_init(**_: Any) -> None:
    """`worker_process_init`: the preemption flag on SIGUSR2, and CUDA retirement."""
    from celery_ojs_ml.checkpoint import install_child_handler

    install_child_handler()
    if child.RECYCLE["mode"] == "cuda":
        child.install_cuda_retirement()
    if child.RECYCLE["mode"] == "warm":
        warm_pool.reset_slot()
        _WATCH["cuda"] = child.DriverWatch()


def _child_prerun(task: Any = None, **_: Any) -> None:
    """`task_prerun` in a pool child: clear the preemption flag, then pin the devices
    (`child.pin_request`). One receiver per signal: Celery sends each signal that has
    receivers once per task, and `task_success` has none (see `_child_postrun`)."""
    reset_flag()
    child.pin_request(getattr(task, "request", None))


_WATCH: dict[str, Any] = {}


def _child_postrun(task: Any = None, retval: Any = None, state: Any = None, **_: Any) -> None:
    """`task_postrun` in a pool child: restore the environment (`child.unpin_request`),
    store a gang rank's success (`gangs.store_rank_result`, which Celery's `task_success`
    would carry at the cost of one more signal per task), and in warm mode record the
    device set the child's CUDA came up with (`warm_pool`)."""
    request = getattr(task, "request", None)
    try:
        child.unpin_request(request)
        if state == SUCCESS and is_rank(request):
            store_rank_result(sender=task, result=retval)
    finally:
        watch = _WATCH.get("cuda")
        if watch is not None:
            devices = getattr(request, "ojs_devices", None)
            warm_pool.bind_after_task(list(devices) if devices else None, watch)
