"""The live fleet as `celery ojs-ml status` and `explain TASK_ID` see it: gather, locate, render.

Key decision: two sources are merged. Inspect replies (`ojs_ml_status`) are
fresh and authoritative for the workers that answer; the store's live registry
(heartbeats) also lists workers that are alive but do not answer in time, and
holds the pending records of jobs no live worker could run. A worker found only
in the store is shown as "not answering", with its last advertised state.
The report is one JSON-able dict, so `--json` and the text view cannot disagree.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery_ojs_ml.capabilities import parse_capabilities
from celery_ojs_ml.cli import progress, queued, sched
from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.matching.filters import fmt
from celery_ojs_ml.spec.flux_rules import is_int

if TYPE_CHECKING:  # the offline verbs share this package and should not pay for importing Celery
    from celery_ojs_ml.plugin import OJSML

ANSWERING, NOT_ANSWERING, NO_GATE = "answering", "not answering", "no ojs-ml gate"
_FREE_FIELDS = {"gpus": "gpu_count", "cpu_cores": "cpu_cores", "memory_gb": "memory_gb"}
_WIDTH = 100
_PINNING: dict[Any, str] = {True: "CUDA_VISIBLE_DEVICES per task", False: "off (not prefork)"}


def inspect_status(plugin: OJSML, timeout: float) -> dict[str, dict[str, Any]]:
    """`{worker: ojs_ml_status reply}` from every worker that answers within `timeout` s."""
    replies = plugin.app.control.broadcast("ojs_ml_status", reply=True, timeout=timeout) or []
    return {name: body for reply in replies for name, body in reply.items()}


def gather(plugin: OJSML, timeout: float) -> dict[str, Any]:
    """The status report: `{"workers": {name: view}, "pending": {task_id: record}, "errors"}`."""
    replies = inspect_status(plugin, timeout)
    errors: list[str] = []
    try:
        store = plugin.store
        live, pending, held = store.live_workers(), store.pending(), store.held()
    except Exception as exc:  # the inspect half is still worth showing
        errors.append(f"store unavailable: {exc}")
        live, pending, held = {}, {}, {}
    try:
        scheduled = sched.scheduler_part(plugin)
    except Exception as exc:
        errors.append(f"scheduler state unavailable: {exc}")
        scheduled = {"leader": None, "jobs": {}}
    try:
        grants = queued.grants_part(plugin)
    except Exception as exc:
        errors.append(f"grants unavailable: {exc}")
        grants = []
    now = time.time()
    workers = {
        name: _view(replies.get(name), live.get(name), held.get(name), now)
        for name in sorted(set(replies) | set(live))
    }
    progress.attach(plugin, workers)  # running jobs' last PROGRESS state, if any
    return {
        "workers": workers,
        "pending": pending,
        "scheduler": scheduled,
        "grants": grants,
        "errors": errors,
        "time": now,
    }


def _view(
    reply: dict[str, Any] | None,
    live: dict[str, Any] | None,
    held: list[dict[str, Any]] | None,
    now: float,
) -> dict[str, Any]:
    if reply is not None and "error" not in reply:
        alloc = reply.get("allocator", {})
        return {
            "state": ANSWERING,
            "capabilities": reply.get("capabilities", {}),
            "labels": reply.get("labels", {}),
            **_allocator_part(alloc, alloc.get("held", [])),
            "queues": reply.get("queues", []),
            "pinning": reply.get("pinning"),
            "processes": reply.get("processes"),
            "plain_running": reply.get("plain_running"),
        }
    if live is None:  # answers inspect, but runs without the plugin's gate
        return {"state": NO_GATE, "error": (reply or {}).get("error", "no reply")}
    caps_doc = live.get("capabilities", {})
    alloc = live.get("free", {})
    return {
        "state": NOT_ANSWERING,
        "capabilities": caps_doc.get("capabilities", caps_doc),
        "labels": _labels(caps_doc),
        **_allocator_part(alloc, held if held is not None else alloc.get("held", [])),
        "queues": [],
        "pinning": live.get("info", {}).get("pinning"),
        "processes": live.get("info", {}).get("processes"),
        "plain_running": live.get("info", {}).get("plain_running"),
        "heartbeat_age_s": round(now - float(live.get("ts", now)), 1),
    }


def _allocator_part(alloc: dict[str, Any], held: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "capacity": alloc.get("capacity", {}),
        "free": alloc.get("free", {}),
        "devices": alloc.get("devices", {}),
        "allocations": alloc.get("allocations", []),
        "held": held,
    }


def _labels(caps_doc: dict[str, Any]) -> dict[str, str]:
    try:
        return parse_capabilities(caps_doc).derived_labels()
    except SpecError:
        return {}


# -- explain: where a task id is --------------------------------------------------------------


def locate(task_id: str, report: dict[str, Any]) -> dict[str, Any]:
    """Where a task is: waiting (pending record), running or held on a worker, else unknown."""
    job = (report.get("scheduler") or {}).get("jobs", {}).get(task_id)
    if job is not None:
        reason = (report["pending"].get(task_id) or {}).get("reason")
        if job["state"] == "pending" and reason and "scheduler's pass" in job["reason_pending"]:
            job = {**job, "reason_pending": reason}
        return {"task_id": task_id, **job}
    record = report["pending"].get(task_id)
    if record is not None:
        return {
            "task_id": task_id,
            "state": "pending",
            "reason_pending": record.get("reason"),
            "t_estimate": None,
            "worker": None,
            **record,
        }
    for name, view in report["workers"].items():
        for alloc in view.get("allocations", []):
            if alloc.get("task_id") == task_id:
                return {"task_id": task_id, "state": "running", "worker": name, **alloc}
        for held in view.get("held", []):
            if held.get("task_id") == task_id:
                return {"task_id": task_id, "state": "held", "worker": name, **held}
    return {"task_id": task_id, "state": "unknown"}


def render_location(found: dict[str, Any], now: float) -> str:
    """One line (two for waiting jobs) saying where a task is and why."""
    tid, state = found["task_id"], found["state"]
    if state == "pending":
        start = found.get("t_estimate")
        when = f"; estimated start in {max(0.0, start - now):.0f} s" if start else ""
        return f"{tid} waits ({_job_facts(found, now)}{when}):\n    {found.get('reason_pending')}"
    if state == "assigned":
        return f"{tid} is assigned to {found['worker']} and about to start"
    if state == "running":
        gpus = ", ".join(str(d) for d in found.get("devices", [])) or "none"
        line = f"{tid} runs on {found['worker']} with GPU(s) {gpus} (band {found.get('band')})"
        report = found.get("progress")
        return f"{line}: {progress.describe(report)}" if isinstance(report, dict) else line
    if state == "held":
        return f"{tid} is held on {found['worker']} (band {found.get('band')}): {found['reason']}"
    if state == "queued":
        return queued.render_queued(found)
    if state == "dead":
        last = found.get("last_checkpoint") or {}
        resume = f"epoch {last.get('epoch')}" if last else "the start (no checkpoint)"
        return (
            f"{tid} was dead-lettered: {found.get('reason')}; "
            f"`celery ojs-ml dead --retry {tid}` re-publishes it, from {resume}"
        )
    where = found.get("note") or "nor is it in a requirement-class queue"
    return (
        f"{tid} is unknown: no pending record, and no answering ojs-ml worker runs or holds it, "
        f"{where} (it may have finished, or never been published)"
    )


# -- rendering ------------------------------------------------------------------------------


def render_status(report: dict[str, Any]) -> str:
    """The human view: one block per worker, then the waiting jobs with their reasons."""
    scheduled = (report.get("scheduler") or {}).get("jobs") or {}
    blocks = [
        _worker_block(name, view, _reserved_on(name, scheduled, report["time"]))
        for name, view in report["workers"].items()
    ]
    if not blocks:
        blocks = ["no ojs-ml workers: none answered inspect and the store lists none live"]
    if "scheduler" in report:  # gather() always reads it; a hand-built report may not
        blocks.append(sched.render(report["scheduler"] or {}, report["time"]))
    if report.get("grants"):
        blocks.append(queued.render_grants(report["grants"]))
    blocks.append(_pending_block(report["pending"], report["time"]))
    blocks.extend(f"warning: {e}" for e in report["errors"])
    return "\n\n".join(blocks)


def _reserved_on(worker: str, jobs: dict[str, Any], now: float) -> list[str]:
    """The waiting jobs the scheduler holds this worker's capacity for (its reservations)."""
    out = []
    for task_id, job in sorted(jobs.items(), key=lambda kv: kv[1].get("since") or 0):
        if job.get("state") != "pending" or job.get("worker") != worker:
            continue
        start = job.get("t_estimate")
        when = f"starts in ~{max(0.0, start - now):.0f} s" if start else "start unknown"
        out.append(f"{task_id} ({when})")
    return out


def _worker_block(name: str, view: dict[str, Any], reserved: Sequence[str] = ()) -> str:
    state = view["state"]
    if state == NO_GATE:
        return f"{name}  {NO_GATE}: {view.get('error')}"
    if state == NOT_ANSWERING:
        state += f" (last heartbeat {fmt(view.get('heartbeat_age_s'))} s ago; state from the store)"
    lines = [f"{name}  {state}  {_headline(view['labels'])}"]
    lines += _field("labels", " ".join(f"{k}={v}" for k, v in view["labels"].items()))
    lines += _field("free", _free_line(view["capacity"], view["free"]))
    lines += _processes_lines(
        view.get("processes"), len(view["allocations"]), view.get("plain_running")
    )
    lines += _field("pinning", _PINNING.get(view.get("pinning"), "unknown"))
    lines += _device_lines(view["devices"], view["allocations"])
    for task_id, text in progress.lines(view["allocations"]):
        lines += _field("progress", f"{task_id} {text}")
    lines += _held_lines(view["held"])
    for entry in reserved:
        lines += _field("reserved", entry)
    if view.get("queues"):
        lines += _field("queues", ", ".join(view["queues"]))
    return "\n".join(lines)


def _headline(labels: dict[str, str]) -> str:
    count, gpu = labels.get("gpu_count", "0"), labels.get("gpu_type")
    if gpu and count != "0":
        return f"{count}x {gpu}"
    return str(labels.get("accelerator", "accelerator unknown"))


def _field(label: str, text: str) -> list[str]:
    prefix = f"  {label:<9} "
    return textwrap.wrap(
        text or "-",
        width=_WIDTH,
        initial_indent=prefix,
        subsequent_indent=" " * len(prefix),
        break_on_hyphens=False,
    )


def _processes_lines(processes: Any, jobs: int, plain: Any = None) -> list[str]:
    """The pool's processes free for ML jobs (what the fleet scheduler counts): less its
    ML jobs and the plain Celery tasks running there; and the jobs waiting in the pool's
    queue for one. None where the worker did not report its pool."""
    if not is_int(processes) or processes < 1:
        return []
    others = plain if is_int(plain) and plain > 0 else 0
    busy = jobs + others
    text = f"{max(0, processes - busy)}/{processes} free"
    if others:
        text += f" ({others} plain task(s) running)"
    if busy > processes:
        text += f", {busy - processes} job(s) waiting in the pool for a process"
    return _field("processes", text)


def _free_line(capacity: dict[str, Any], free: dict[str, Any]) -> str:
    shown = [k for k, total in capacity.items() if total]
    return ", ".join(f"{k} {fmt(free.get(k))}/{fmt(capacity[k])}" for k in shown)


def _device_lines(devices: dict[str, Any], allocations: list[dict[str, Any]]) -> list[str]:
    bands = {a.get("task_id"): a.get("band") for a in allocations}
    lines = []
    for index, task_id in sorted(devices.items(), key=lambda kv: int(kv[0])):
        text = f"{task_id} (band {bands.get(task_id)})" if task_id else "free"
        lines += _field(f"gpu {index}", text)
    return lines


def _held_lines(held: list[dict[str, Any]]) -> list[str]:
    if not held:
        return _field("held", "none")
    lines = []
    for job in held:
        text = f"{job.get('task_id')} (band {job.get('band')}): {job.get('reason')}"
        lines += _field("held", text)
    return lines


def _pending_block(pending: dict[str, dict[str, Any]], now: float) -> str:
    if not pending:
        return "waiting jobs: none"
    lines = [f"waiting jobs: {len(pending)}"]
    for task_id, record in sorted(pending.items(), key=lambda kv: kv[1].get("since", 0)):
        lines.append(f"  {task_id}  {_job_facts(record, now)}")
        lines.extend(_field("  reason", str(record.get("reason"))))
    return "\n".join(lines)


def _job_facts(record: dict[str, Any], now: float) -> str:
    since = record.get("since")
    waited = f"waiting {fmt(round(now - float(since)))} s" if since is not None else "waiting"
    return f"{record.get('task')}, queue {record.get('queue')}, band {record.get('band')}, {waited}"
