"""The exporter's metric families: names, help texts, label names and histogram buckets.

Key decision: one catalogue, so `metric_names()`, the collector and docs/metrics.md
cannot drift apart. Labels are worker names, GPU types, bands, logical queues and
states only, never task ids: a fleet's series count stays bounded by its size.
Counter names carry their `_total` suffix as the `# HELP` line of a scrape shows it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family: name as in `# HELP`, type, help text, label names."""

    name: str
    kind: str
    """One of "gauge", "counter", "histogram"."""
    help: str
    labels: tuple[str, ...] = ()


GPUS = Family(
    "ojs_ml_gpus",
    "gauge",
    "GPUs per live worker, free or allocated.",
    ("worker", "gpu_type", "state"),
)
JOBS = Family(
    "ojs_ml_jobs",
    "gauge",
    "ML jobs waiting in the pending set (pending) or running on a live worker (running).",
    ("state", "band", "queue"),
)
WAIT = Family(
    "ojs_ml_job_wait_seconds",
    "histogram",
    "Time from a job's admission (or publish under a grant) to its start by a worker's gate.",
    ("band",),
)
WORKERS = Family("ojs_ml_workers", "gauge", "Workers with an unexpired heartbeat in the store.")
LEADER = Family(
    "ojs_ml_leader", "gauge", "1 for the candidate holding the scheduler lock.", ("leader",)
)
PASS = Family(
    "ojs_ml_scheduler_pass_seconds",
    "gauge",
    "Duration of the leader's last scheduling pass, as of its last lock renewal.",
)
PREEMPTIONS = Family(
    "ojs_ml_preemptions_total",
    "counter",
    "Jobs preempted (re-published), by their band.",
    ("band",),
)
CRASHES = Family(
    "ojs_ml_job_crashes_total",
    "counter",
    "Jobs whose worker died or restarted while they ran (their lease was claimed).",
    ("queue",),
)
DEAD = Family("ojs_ml_dead_letters", "gauge", "Jobs in the dead-letter set.")
ESCALATIONS = Family(
    "ojs_ml_escalations_total",
    "counter",
    "Waiting jobs the scheduler escalated to another band (OJS ML section 8.4).",
    ("band_from", "band_to"),
)
SAVES = Family(
    "ojs_ml_checkpoint_saves_total", "counter", "Checkpoints committed, by queue.", ("queue",)
)
SAVE_SECONDS = Family(
    "ojs_ml_checkpoint_save_seconds",
    "histogram",
    "Time to write and commit one checkpoint (payload and metadata).",
)
SAVED_BYTES = Family(
    "ojs_ml_checkpoint_bytes_total",
    "counter",
    "Bytes of checkpoint payload committed, by queue.",
    ("queue",),
)
BUDGET = Family(
    "ojs_ml_budget_gpus",
    "gauge",
    "GPUs held against each budgeted queue (used) and its max_total_gpus (limit).",
    ("queue", "state"),
)
RESERVATIONS = Family("ojs_ml_reservations", "gauge", "Reservation records by state.", ("state",))
SHARE = Family(
    "ojs_ml_gpu_share_bytes",
    "gauge",
    "GPU-share VRAM per worker: handed to running shares (allocated) and of its GPUs (total).",
    ("worker", "state"),
)
PROGRESS = Family(
    "ojs_ml_progress_events_total", "counter", "ojs-progress events received, by queue.", ("queue",)
)

GAUGES = (GPUS, JOBS, WORKERS, LEADER, PASS, DEAD, BUDGET, RESERVATIONS, SHARE)
"""Read from the store on every scrape."""
EVENTS = (WAIT, PREEMPTIONS, CRASHES, ESCALATIONS, SAVES, SAVE_SECONDS, SAVED_BYTES, PROGRESS)
"""Fed by the Celery event stream since the exporter started."""

WAIT_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
"""Seconds: GPU jobs wait from seconds to a day."""
SAVE_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Seconds: a checkpoint of a small model to one of a large model on object storage."""


def metric_names() -> frozenset[str]:
    """Every metric family the exporter serves, named as in a scrape's `# HELP` lines."""
    return frozenset(f.name for f in (*GAUGES, *EVENTS))
