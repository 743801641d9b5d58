"""Which TPU chips a dispatched job runs on (the TPU half of pinning, OJS ML §3.3).

The allocator counts a worker's TPU chips (`Demand.tpu_chips`); the gate turns
the count into chip indices here, and the pool child selects exactly those
chips for the task body (`child.tpu_env`), as `ojs_devices` does for GPUs.

Key decisions:
- A running job's chips are the `ojs_tpu_chips` of its request, so nothing
  else has to be kept or freed: the gate drops a finished request before the
  allocator frees its count, so there are always enough chips free when the
  count fits.
- The lowest free indices are taken. A job's chips then tend to be adjacent,
  and libtpu selects a sub-slice by index order (`child.tpu_env`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.wire.headers import TPU_CHIPS

log = logging.getLogger(__name__)


def pick_chips(count: int, total: int, taken: Iterable[int]) -> list[int]:
    """The `count` lowest chip indices below `total` that are not `taken`.

    Short of free chips (a bookkeeping error elsewhere), it takes the lowest
    taken ones too and logs it: the job then fails at libtpu's "chip in use",
    loudly, instead of never starting.
    """
    busy = set(taken)
    free = [i for i in range(total) if i not in busy]
    if len(free) < count:
        log.error(
            "ojs-ml: %d TPU chip(s) wanted but only %s of %d free; sharing chips %s",
            count,
            free,
            total,
            sorted(busy)[: count - len(free)],
        )
        free += sorted(busy)[: count - len(free)]
    return free[:count]


def assign_chips(
    headers: dict[str, Any], chips: int, caps: Capabilities, running: Mapping[str, Any]
) -> None:
    """Put the chips of a dispatched job asking for `chips` into its headers (`ojs_tpu_chips`);
    `running` is the gate's running requests by task id."""
    if chips <= 0:
        return
    total = caps.tpu.chip_count if caps.tpu is not None else 0
    taken = (
        c
        for req in list(running.values())  # a copy: a release may pop one meanwhile
        if (getattr(req, "request_dict", None) or {}) is not headers
        for c in (getattr(req, "request_dict", None) or {}).get(TPU_CHIPS) or ()
    )
    headers[TPU_CHIPS] = pick_chips(chips, total, taken)
