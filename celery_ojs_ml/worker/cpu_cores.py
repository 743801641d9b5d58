"""Which CPUs a dispatched job runs on, and the memory bound its pool child applies.

The allocator counts a worker's CPU cores and memory (`Demand.cpu_cores`,
`Demand.memory_gb`); the gate turns a job's count of cores into CPU ids here
(`ojs_cpus`) and, for a job without GPUs or TPU chips, passes its
`ext_ml_memory_gb` on (`ojs_memory_limit`). The pool child pins itself to those
CPUs and bounds its address space for the task body (`child.limits`).

Key decisions:
- A job asking for 1.5 cores gets 2 CPUs: affinity is whole CPUs.
- CPU ids come from the worker's own affinity (`os.sched_getaffinity` of its
  main process), least-used first, then lowest id: while the declared cores fit
  the machine, running jobs' CPUs are disjoint. A worker that declares more
  cores than it has shares its CPUs evenly rather than refusing.
- A running job's CPUs are the `ojs_cpus` of its request, as a TPU job's chips
  are its `ojs_tpu_chips` (`worker.tpu_chips`): nothing else is kept or freed.
- A MemoryError from a bounded job ends that job only (`_bounded_failure`).
- No address-space bound for GPU or TPU jobs: their drivers reserve far more
  virtual memory than any host has (CUDA's unified addressing), so such a bound
  would stop them at start-up, not at `ext_ml_memory_gb`.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from celery_ojs_ml.allocator import Allocation
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.errors import OJSMLError
from celery_ojs_ml.wire.headers import CPUS, MEMORY_LIMIT
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker.tpu_chips import assign_chips


def pick_cpus(count: int, available: Iterable[int], taken: Iterable[int]) -> list[int]:
    """`count` CPU ids of `available` (at most all of them), least used in `taken` first."""
    uses = Counter(taken)
    order = sorted(set(available), key=lambda cpu: (uses[cpu], cpu))
    return sorted(order[: max(0, count)])


class MemoryBoundExceeded(OJSMLError):
    """A job went past its `ext_ml_memory_gb` bound: its failure, not the worker's."""


def assign_host(
    req: Any,
    alloc: Allocation,
    caps: Capabilities,
    running: Mapping[str, Any],
    settings: OJSMLSettings,
) -> None:
    """Put a dispatched request's TPU chips, CPUs and memory bound into its headers;
    `running` is the gate's running requests by task id."""
    headers: dict[str, Any] = req.request_dict
    assign_chips(headers, alloc.tpu_chips, caps, running)  # TPU: worker.tpu_chips
    if settings.pin_cpus and alloc.cpu_cores > 0:
        taken = (
            cpu
            for req in list(running.values())  # a copy: a release may pop one meanwhile
            if (getattr(req, "request_dict", None) or {}) is not headers
            for cpu in (getattr(req, "request_dict", None) or {}).get(CPUS) or ()
        )
        wanted = math.ceil(alloc.cpu_cores)
        headers[CPUS] = pick_cpus(wanted, os.sched_getaffinity(0), taken)
    if settings.limit_memory and alloc.memory_gb > 0 and not (alloc.devices or alloc.tpu_chips):
        headers[MEMORY_LIMIT] = alloc.memory_gb
        req.on_failure = _bounded_failure(alloc.memory_gb, req.on_failure)


def _bounded_failure(limit_gb: float, original: Any) -> Any:
    """The request's `on_failure`, with a MemoryError from the bounded task body handed on
    as `MemoryBoundExceeded`: Celery 5.7's `Request.on_failure` stops the whole worker on
    a MemoryError from a pool child (`raise MemoryError('Process got: ...')`), which under
    the bound is the job's own failure (`test_resource_enforcement.py` fails if that goes)."""

    def on_failure(exc_info: Any, *args: Any, **kwargs: Any) -> Any:
        wrapper = getattr(exc_info, "exception", None)
        exc = getattr(wrapper, "exc", wrapper)  # billiard's ExceptionWithTraceback
        if isinstance(exc, MemoryError):
            named = MemoryBoundExceeded(f"ext_ml_memory_gb {limit_gb:g} exceeded: {exc}")
            if wrapper is not None and wrapper is not exc:
                wrapper.exc = named
            else:
                exc_info.exception = named
        return original(exc_info, *args, **kwargs)

    return on_failure
