"""The worker's entries in `celery inspect stats`, and so in Flower's worker page.

Key decisions:
* Flat, dotted top-level keys (`"ojs_ml.gpus": "1/2 free (nvidia-a100 80 GB, nvlink)"`)
  whose values are short strings, numbers and booleans. Flower 2.2's worker page
  shows every stats key it does not know as one row of its "Other" tab, `str(value)`
  beside the key: a nested document would be one row of raw Python repr, a flat
  `ojs_ml` dict too. `/api/workers` carries the same keys.
* The full nested document stays where scripts read it: `celery inspect
  ojs_ml_status` and `celery ojs-ml status --json` (`MLWorker.snapshot`).
* Built from that snapshot, so both views say the same; nothing here reads the
  store: `inspect stats` costs no round trip.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery_ojs_ml import celery_internals as internals
from celery_ojs_ml.wire.warm_slots import TAINTED, devices_of_mask

PREFIX = "ojs_ml."
Scalar = str | int | float | bool
PINNING = {True: "CUDA_VISIBLE_DEVICES per task", False: "off (request.ojs_devices)"}


def flat_stats(
    snap: Mapping[str, Any], *, leader: bool, warm: str | None = None
) -> dict[str, Scalar]:
    """`MLWorker.snapshot()` as flat `ojs_ml.*` pairs (see module doc); `leader`: this
    worker's candidate holds the scheduler lock; `warm`: `warm_children(router)`."""
    caps, alloc = snap["capabilities"], snap["allocator"]
    out: dict[str, Scalar | None] = {
        "gpus": gpu_summary(caps, alloc),
        "devices": device_holders(alloc),
        "sharing": share_summary(alloc.get("gpu_free_milli")),
        "tpus": tpu_summary(caps, alloc),
        "cpu": cpu_summary(alloc),
        "running": len(alloc["allocations"]),
        "bands": band_counts(alloc["allocations"]),
        "held": len(alloc["held"]),
        "waiting": first_held(alloc["held"]),
        "reservations": len(alloc["reservations"]) if alloc.get("reservations") else None,
        "nvlink_free": alloc.get("nvlink_free"),
        "leader": leader,
        "queues": ", ".join(snap["queues"]) or "none",
        "pinning": PINNING[bool(snap["pinning"])],
        "processes": snap.get("processes"),
        "plain_running": snap.get("plain_running"),
        "warm": warm,
        "labels": ", ".join(f"{k}={v}" for k, v in snap["labels"].items()),
    }
    return {PREFIX + key: value for key, value in out.items() if value is not None}


def _num(value: Any) -> str:
    """`256.0` -> `256`, `12.5` -> `12.5`."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def gpu_summary(caps: Mapping[str, Any], alloc: Mapping[str, Any]) -> str:
    """`1/2 free (nvidia-a100 80 GB, nvlink)`; `none` on a worker without GPUs."""
    total = alloc["capacity"].get("gpu_count", 0)
    gpu = caps.get("gpu") or {}
    if not total:
        return "none"
    about = [gpu.get("type") or "gpu"]
    if gpu.get("memory_gb"):
        about[0] += f" {_num(gpu['memory_gb'])} GB"
    if gpu.get("interconnect"):
        about.append(str(gpu["interconnect"]))
    return f"{alloc['free'].get('gpu_count', 0)}/{total} free ({', '.join(about)})"


def device_holders(alloc: Mapping[str, Any]) -> str | None:
    """`0,1: <task id>; 2: <task id>; free: 3`: the devices each job holds (a GPU share
    with its milli-GPU: `0: <id> 500m, <id> 500m`), then the free ones."""
    if not alloc["devices"]:
        return None
    holders: dict[int, list[str]] = {int(i): [] for i in alloc["devices"]}
    for a in alloc["allocations"]:
        share = f" {a['gpu_milli']}m" if a.get("gpu_milli") else ""
        for device in a["devices"]:
            holders.setdefault(int(device), []).append(f"{a['task_id']}{share}")
    groups: dict[str, list[str]] = {}
    for i, held_by in sorted(holders.items()):
        groups.setdefault(", ".join(held_by) or "free", []).append(str(i))
    free = groups.pop("free", None)
    parts = [f"{','.join(devices)}: {who}" for who, devices in groups.items()]
    return "; ".join(parts + ([f"free: {','.join(free)}"] if free else []))


def share_summary(free_milli: Sequence[int] | None) -> str | None:
    """`milli-GPU free: 0: 250/1000, 1: 1000/1000` while GPU sharing is on, else None."""
    if free_milli is None:
        return None
    return "milli-GPU free: " + ", ".join(f"{i}: {m}/1000" for i, m in enumerate(free_milli))


def tpu_summary(caps: Mapping[str, Any], alloc: Mapping[str, Any]) -> str | None:
    """`8/8 chips free (v5e 2x4)` on a TPU worker, else None."""
    total = alloc["capacity"].get("tpu_chip_count", 0)
    if not total:
        return None
    tpu = caps.get("tpu") or {}
    about = " ".join(str(tpu[k]) for k in ("type", "topology") if tpu.get(k))
    free = alloc["free"].get("tpu_chip_count", 0)
    return f"{free}/{total} chips free" + (f" ({about})" if about else "")


def cpu_summary(alloc: Mapping[str, Any]) -> str:
    """`22/24 cores, 240/256 GB memory free`: what ML jobs have not taken."""
    cap, free = alloc["capacity"], alloc["free"]
    cores = f"{_num(free.get('cpu_cores', 0))}/{_num(cap.get('cpu_cores', 0))} cores"
    memory = f"{_num(free.get('memory_gb', 0))}/{_num(cap.get('memory_gb', 0))} GB memory"
    return f"{cores}, {memory} free"


def band_counts(allocations: Sequence[Mapping[str, Any]]) -> str | None:
    """`batch 2, interactive 1`: the running ML jobs by priority band; None when idle."""
    counts = Counter(str(a.get("band")) for a in allocations)
    return ", ".join(f"{band} {n}" for band, n in sorted(counts.items())) or None


def first_held(held: Sequence[Mapping[str, Any]]) -> str | None:
    """The first held job and why it waits (`<id> (batch): <reason>`), or None."""
    if not held:
        return None
    first = held[0]
    more = f" (+{len(held) - 1} more)" if len(held) > 1 else ""
    return f"{first['task_id']} ({first['band']}): {first['reason']}{more}"


def warm_children(router: Any) -> str | None:
    """`2/4 bound: 0; 1, 7 warm starts, 0 retired`: the pool children bound to device
    sets (`warm_pool.Router`), or None where warm children are off."""
    if router is None:
        return None
    bindings = []
    for fd in internals.pipes(router.pool):
        index = getattr(internals.process_of(router.pool, fd), "index", None)
        if index is not None:
            bindings.append(router.table.binding(int(index)))
    bound = sorted(devices_of_mask(b) for b in bindings if b and b != TAINTED)
    sets = "; ".join(",".join(map(str, d)) for d in bound)
    return (
        f"{len(bound)}/{len(bindings)} bound" + (f": {sets}" if sets else "")
        + f", {router.warm_hits} warm starts, {router.retired} retired"
        + (f", {router.pipelined} pipelined" if getattr(router, "pipelined", 0) else "")
    )  # fmt: skip


def started_fields(running: Any, allocator: Any) -> Callable[[Any], dict[str, Any] | None]:
    """`fields_for(task_id)` for `internals.add_task_started_fields`: an ML job's
    `task-started` event carries its band and devices (`ojs_band`, `ojs_devices`, and
    `ojs_gpu_milli` for a GPU share); None for a task that holds no allocation here."""

    def fields_for(task_id: Any) -> dict[str, Any] | None:
        with running.lock:
            request = running.requests.get(task_id)
            job = allocator.book.get(request) if request is not None else None
        if job is None:
            return None
        a = job.alloc
        fields = {"ojs_band": a.band, "ojs_devices": ", ".join(map(str, a.devices)) or "none"}
        return {**fields, "ojs_gpu_milli": a.gpu_milli} if a.gpu_milli else fields

    return fields_for
