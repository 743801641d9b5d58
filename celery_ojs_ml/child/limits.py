"""Pool-child side: a job's CPUs and memory bound around its task body (OJS ML §3.4, §3.5).

The gate picks the CPUs (`ojs_cpus`) and passes the memory bound on
(`ojs_memory_limit`, `worker.cpu_cores`). `task_prerun` pins the child to those
CPUs and lowers its address-space limit; `task_postrun` names a failure the
bound caused, then gives the child the worker's CPUs and its own limit back.

Key decisions:
- Affinity is the calling thread's (Linux `sched_setaffinity(0)`): the task's
  thread and every thread it starts run on the job's CPUs.
- The bound is `RLIMIT_AS`, the address space the child has when the task starts
  plus `ext_ml_memory_gb`: an allocation past it fails with MemoryError in the
  task, and the child lives on. Only the soft limit is lowered (an unprivileged
  process cannot raise its hard limit again), never raised above what it was.
  A cgroup's `memory.max` is not used: the kernel's OOM killer would end the
  child, losing the job's reason with it.
- A bounded job's outcome is stored here, a failure under the bound naming it: its
  request runs with `ignore_result`, so that Celery does not store the bare
  MemoryError first, where a client waiting on the result would see it (Celery
  5.7 reads the request's `ignore_result` again when it stores an outcome, after
  `task_prerun`: `TraceInfo.handle_error_state`, `Backend.mark_as_done`); the
  chord and error callbacks Celery calls go on as usual.
"""

from __future__ import annotations

import logging
import os
import resource
import traceback
from typing import Any

from celery.states import FAILURE, RETRY, SUCCESS

from celery_ojs_ml.wire.headers import CPUS, MEMORY_LIMIT, PIN

log = logging.getLogger(__name__)
GIB = 1 << 30
_SAVED_CPUS = "ojs_saved_cpus"
_SAVED_AS = "ojs_saved_rlimit_as"
_STORES = "ojs_limits_store"


def set_limits(request: Any) -> None:
    """`task_prerun`: pin the job's CPUs, bound its address space (prefork only)."""
    if not getattr(request, PIN, False):
        return
    cpus = getattr(request, CPUS, None)
    if isinstance(cpus, list) and cpus:
        try:
            before = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, [int(c) for c in cpus])
            setattr(request, _SAVED_CPUS, before)
        except (OSError, ValueError, TypeError) as exc:
            log.warning("ojs-ml: cannot pin %s to CPUs %s: %s", request.id, cpus, exc)
    limit = getattr(request, MEMORY_LIMIT, None)
    if isinstance(limit, int | float) and not isinstance(limit, bool) and limit > 0:
        _bound_memory(request, float(limit))


def address_space(statm: str = "/proc/self/statm") -> int | None:
    """This process's address space in bytes (VmSize); None where it cannot be read."""
    try:
        with open(statm, encoding="ascii") as fh:
            return int(fh.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None


def _bound_memory(request: Any, limit_gb: float) -> None:
    now = address_space()
    if now is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    wanted = now + int(limit_gb * GIB)
    for cap in (soft, hard):
        if cap != resource.RLIM_INFINITY:
            wanted = min(wanted, cap)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (wanted, hard))
    except (OSError, ValueError) as exc:
        log.warning("ojs-ml: cannot bound the memory of %s: %s", request.id, exc)
        return
    setattr(request, _SAVED_AS, (soft, wanted, limit_gb))
    if not getattr(request, "ignore_result", False):  # stored in `finish` instead
        request.ignore_result = True
        setattr(request, _STORES, True)


def finish(task: Any, request: Any, state: Any, retval: Any) -> None:
    """`task_postrun`: lift the bound and the pinning, then store a bounded job's failure
    (naming the bound)."""
    _restore(request)
    try:
        if getattr(request, _STORES, False):
            request.ignore_result = False
            _store_outcome(task, request, state, retval)
    except Exception as exc:  # never out of the hook: the child must go on
        log.warning("ojs-ml: could not store the outcome of %s: %r", request.id, exc)


def _store_outcome(task: Any, request: Any, state: Any, retval: Any) -> None:
    """What Celery would have stored for the request (it re-reads `ignore_result`
    for every outcome), with a MemoryError under the bound named."""
    if state == SUCCESS:
        if not getattr(task, "ignore_result", False):
            task.backend.store_result(request.id, retval, SUCCESS, request=request)
        return
    if state == RETRY:
        cause = getattr(retval, "exc", None)
        task.backend.mark_as_retry(request.id, cause, request=request)
        return
    if state != FAILURE or not isinstance(retval, BaseException):
        return
    exc = retval
    saved = getattr(request, _SAVED_AS, None)
    if isinstance(exc, MemoryError) and saved is not None:
        exc = MemoryError(memory_reason(saved[2], saved[1]))
        exc.__cause__ = retval
    text = "".join(traceback.format_exception(retval))
    task.backend.store_result(request.id, exc, FAILURE, traceback=text, request=request)


def memory_reason(limit_gb: float, bound: int) -> str:
    """The failure of a job that went past its memory bound."""
    return (
        f"ext_ml_memory_gb {limit_gb:g} exceeded: the job ran out of its memory bound "
        f"(an address space of {bound >> 20} MiB, RLIMIT_AS) (OJS ML §3.4); ask for "
        f'more, e.g. "ext_ml_memory_gb": {limit_gb * 2:g}'
    )


def _restore(request: Any) -> None:
    saved = getattr(request, _SAVED_AS, None)
    if saved is not None:
        try:
            resource.setrlimit(resource.RLIMIT_AS, (saved[0], resource.getrlimit(
                resource.RLIMIT_AS)[1]))  # fmt: skip
        except (OSError, ValueError) as exc:
            log.warning("ojs-ml: cannot lift the memory bound after %s: %s", request.id, exc)
    before = getattr(request, _SAVED_CPUS, None)
    if before is not None:
        try:
            os.sched_setaffinity(0, before)
        except OSError as exc:
            log.warning("ojs-ml: cannot restore the CPUs after %s: %s", request.id, exc)
