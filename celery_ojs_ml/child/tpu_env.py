"""Pool-child side: select the task's TPU chips around its body, as CUDA_VISIBLE_DEVICES does
for GPUs (`child.pinning`).

The gate puts the chip indices in the request (`ojs_tpu_chips`, `worker.tpu_chips`);
`task_prerun` sets the variables libtpu reads to open a sub-slice of one host, and
`task_postrun` puts them back as they were.

Key decisions:
- One process on a subset of one host's chips is a single-process slice: libtpu
  needs the chips (`TPU_VISIBLE_CHIPS`), their shape (`TPU_CHIPS_PER_PROCESS_BOUNDS`),
  one process (`TPU_PROCESS_BOUNDS=1,1,1`) and, since several such processes run on
  the host at once, a port of its own (`TPU_PROCESS_PORT`, `TPU_PROCESS_ADDRESSES`).
  Sources: torch_xla `torch_xla/_internal/tpu.py` (`configure_one_chip_topology`,
  `configure_topology`: TPU_VISIBLE_CHIPS, TPU_CHIPS_PER_PROCESS_BOUNDS "1,1,1",
  TPU_PROCESS_BOUNDS, TPU_PROCESS_PORT from 8476, TPU_PROCESS_ADDRESSES
  "localhost:<port>"); Ray `python/ray/_private/accelerators/tpu.py`
  (`set_current_process_visible_accelerator_ids`: TPU_VISIBLE_CHIPS with bounds
  "1,1,1" for 1 chip and "1,2,1" for 2); the JAX tracker's thread on several TPU
  processes per host and the "tpu_topology_env_vars.py" gist it links ("2,2,1" for
  4 chips, a unique port per process). 8 chips are the 2x4 host of v5e/v6e.
- The port is 8476 plus the first chip's index: concurrent jobs on one host hold
  disjoint chips, so their ports never collide, across workers too.
- Chip indices are the worker's own: a worker started with `TPU_VISIBLE_CHIPS=4,5,6,7`
  gives index 0 as chip 4, as `pinning.pinned` does for GPUs.
- libtpu reads these once, when the process first opens the TPU, like CUDA; the
  variables only select chips for a process that has not opened it yet.
"""

from __future__ import annotations

import os
from typing import Any

from celery_ojs_ml.wire.headers import PIN, TPU_CHIPS

VISIBLE = "TPU_VISIBLE_CHIPS"
CHIPS_BOUNDS = "TPU_CHIPS_PER_PROCESS_BOUNDS"
PROCESS_BOUNDS = "TPU_PROCESS_BOUNDS"
ADDRESSES = "TPU_PROCESS_ADDRESSES"
PORT = "TPU_PROCESS_PORT"
NAMES = (VISIBLE, CHIPS_BOUNDS, PROCESS_BOUNDS, ADDRESSES, PORT)
BASE_PORT = 8476
"""libtpu's default process port (torch_xla's `configure_topology` base_port)."""
SHAPES = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
"""Chips per process -> their bounds on one host (see the module doc)."""
_SAVED = "ojs_saved_tpu"


def tpu_env(chips: list[int], topology: Any = None, visible: str | None = None) -> dict[str, str]:
    """The variables that give one process exactly `chips` (allocation indices).

    `topology` is the job's `ext_ml_tpu_topology` ("2x2"), used for the bounds when
    it has as many chips; `visible` is the worker's own TPU_VISIBLE_CHIPS.
    """
    physical = _physical(chips, visible)
    if not physical:  # none of the worker's own chips: leave the environment alone
        return {}
    port = BASE_PORT + min(physical)
    return {
        VISIBLE: ",".join(str(c) for c in physical),
        CHIPS_BOUNDS: _bounds(len(physical), topology),
        PROCESS_BOUNDS: "1,1,1",
        ADDRESSES: f"localhost:{port}",
        PORT: str(port),
    }


def _physical(chips: list[int], visible: str | None) -> list[int]:
    tokens = [t for t in (visible or "").split(",") if t.strip().isdigit()]
    if not tokens:
        return [int(c) for c in chips]
    return [int(tokens[int(c)]) for c in chips if 0 <= int(c) < len(tokens)]


def _bounds(count: int, topology: Any) -> str:
    if isinstance(topology, str):
        dims = [int(d) for d in topology.lower().split("x") if d.isdigit()]
        product = 1
        for d in dims:
            product *= d
        if dims and product == count and len(dims) <= 3:
            return ",".join(str(d) for d in [*dims, 1, 1][:3])
    return SHAPES.get(count, f"1,{count},1")


def set_tpu_env(request: Any) -> None:
    """`task_prerun`: select the request's TPU chips (only when the gate pins: prefork)."""
    chips = getattr(request, TPU_CHIPS, None)
    if not chips or not getattr(request, PIN, False):
        return
    environ = os.environ
    wanted = tpu_env(
        [int(c) for c in chips], getattr(request, "ext_ml_tpu_topology", None), environ.get(VISIBLE)
    )
    setattr(request, _SAVED, {name: environ.get(name) for name in NAMES})
    environ.update(wanted)


def restore_tpu_env(request: Any) -> None:
    """`task_postrun`: put the TPU variables back as they were before the task."""
    saved = getattr(request, _SAVED, None)
    if not isinstance(saved, dict):
        return
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def chips(task: Any) -> list[int]:
    """The TPU chip indices allocated to the running task (any pool); [] for none."""
    found = getattr(getattr(task, "request", None), TPU_CHIPS, None)
    return [int(c) for c in found] if found else []
