"""Remote-control and inspect commands: `celery inspect ojs_ml_status` and friends.

Key decision: the commands live in a module the plugin and the `celery ojs-ml`
CLI both import, because Celery's command registry is process-global and a
client only recognises the commands it has imported (research §4).
"""

from __future__ import annotations

import socket
from typing import Any

from celery.worker.control import control_command, inspect_command

GATES: dict[str, Any] = {}
"""Hostname -> the worker's consumer step (`core.MLWorker`), which these commands read."""


def _gate(state: Any) -> Any:
    return GATES.get(state.hostname)


@inspect_command()  # type: ignore[untyped-decorator]
def ojs_ml_status(state: Any, **_: Any) -> dict[str, Any]:
    """OJS ML: capabilities, free capacity, allocations, held jobs and queues."""
    gate = _gate(state)
    return gate.snapshot() if gate else {"error": f"no ojs-ml gate on {socket.gethostname()}"}


@inspect_command()  # type: ignore[untyped-decorator]
def ojs_ml_capabilities(state: Any, **_: Any) -> dict[str, Any]:
    """OJS ML: this worker's capabilities and derived labels."""
    gate = _gate(state)
    if gate is None:
        return {"error": "no ojs-ml gate"}
    snap = gate.snapshot()
    return {"capabilities": snap["capabilities"], "labels": snap["labels"]}


@inspect_command()  # type: ignore[untyped-decorator]
def ojs_ml_allocations(state: Any, **_: Any) -> dict[str, Any]:
    """OJS ML: which task holds which device, and the held jobs with their reasons."""
    gate = _gate(state)
    if gate is None:
        return {"error": "no ojs-ml gate"}
    alloc = gate.snapshot()["allocator"]
    return {k: alloc[k] for k in ("devices", "allocations", "held", "free", "capacity")}


@control_command(  # type: ignore[untyped-decorator]
    args=[("task_id", str), ("placement", str)], signature="<task_id> <placement>"
)
def ojs_ml_stop_rank(state: Any, task_id: str, placement: str, **_: Any) -> dict[str, Any]:
    """OJS ML: stop a gang rank whose placement failed (sent by the rank that failed first)."""
    from celery_ojs_ml.worker.gangs import stop_rank

    gate = _gate(state)
    if gate is None:
        return {"error": "no ojs-ml gate"}
    stopped = stop_rank(gate.running, gate.stopper.stop_child, task_id, placement)
    return {"ok": "stopping" if stopped else "not running here"}
