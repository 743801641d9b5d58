"""Queue names and the kombu queue definition every side uses, defined once.

Key decision: an ML job is published to the leader's intake queue, or under a
grant straight to one worker's own queue; the leader delivers assignments to
that same per-worker queue. Nothing else carries ML jobs.
"""

from __future__ import annotations

from kombu import Exchange, Queue  # type: ignore[attr-defined]


def worker_queue_name(prefix: str, worker: str) -> str:
    """The queue only `worker` consumes: the scheduler delivers its assignments there."""
    return f"{prefix}.ml.w.{worker}"


def intake_name(prefix: str) -> str:
    """The queue every ML job is published to first; only the fleet scheduler reads it."""
    return f"{prefix}.ml.intake"


def queue_name(logical: str, cid: str, band_name: str) -> str:
    """`<logical queue>.ml.<class id>.<band>`: a per-class queue of versions before the fleet
    scheduler; `celery ojs-ml explain` still finds jobs left in one."""
    return f"{logical}.ml.{cid}.{band_name}"


def ml_queue(name: str, *, declare: bool = True) -> Queue:
    """The one definition of a plugin queue, used by producers and workers alike.

    `declare=False` (a worker re-adding a queue it declared on this connection)
    skips the declaration round trips when it starts consuming again.
    """
    exchange = Exchange(name, type="direct")  # type: ignore[no-untyped-call]
    return Queue(name, exchange, routing_key=name, no_declare=not declare)  # type: ignore[no-untyped-call]


PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")
"""kombu's Redis transport keeps a queue's priority steps in `<queue><sep><n>` lists (kombu 5.7)."""
