"""The fleet's groups and shape buckets, what a start-now search keeps of them, and two
checks of a job's devices.

Key decision: a search for the best worker where a job may start now ranks every
candidate by (free pool process, placement score) first, and every worker of a shape
bucket shares both. `Ties` keeps only the candidates that reach the highest such pair,
so the per-worker steps (picking a bucket's worker by drain time, a reserved worker's
backfill check) run for those alone; the winner is the same as ranking them all.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from celery_ojs_ml.allocator.sharing import pick_share, share_milli
from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.scheduler.drains import Drains
from celery_ojs_ml.scheduler.score import PlacementScore
from celery_ojs_ml.scheduler.slot import Shape, Slot
from celery_ojs_ml.spec.resources import MLRequirements, gpu_share

T = TypeVar("T")
Key = tuple[bool, float]
"""(a pool process is free, placement score total): higher is better."""


class Group:
    """Workers with equal capabilities and queues, bucketed by free shape."""

    __slots__ = (
        "away",
        "buckets",
        "caps",
        "caps_key",
        "drains",
        "idx",
        "members",
        "queues",
        "reserved",
        "shapes",
    )

    def __init__(self, idx: int, caps: Capabilities, caps_key: str, queues: frozenset[str]):
        self.idx = idx
        self.caps = caps
        self.caps_key = caps_key
        self.queues = queues
        self.buckets: dict[Shape, dict[int, None]] = {}
        self.drains: dict[Shape, Drains] = {}  # built when a busy bucket is first searched
        self.reserved: dict[int, None] = {}
        self.away: list[int] = []
        self.members: list[int] = []  # available workers, in fleet order
        self.shapes = 0  # buckets opened or closed so far (members aside)


Rank = tuple[float, bool, int]
"""(`aligned`, no reservation, -index): among candidates tied on score, higher wins."""
Candidate = tuple[Group, Shape, dict[int, None], PlacementScore, Slot | None]
"""A place the job may start now: a shape bucket (its members), or a reserved worker."""


class Ties(Generic[T]):
    """The candidates that share the highest key offered so far."""

    __slots__ = ("items", "key")

    def __init__(self) -> None:
        self.key: Key | None = None
        self.items: list[T] = []

    def below(self, key: Key) -> bool:
        """Whether a candidate with `key` can no longer be among the best."""
        return self.key is not None and key < self.key

    def offer(self, key: Key, item: T) -> None:
        """Keep `item` when its key is the highest so far or ties it."""
        if self.key is None or key > self.key:
            self.key, self.items = key, [item]
        elif key == self.key:
            self.items.append(item)

    def offer_all(self, key: Key, items: list[T]) -> None:
        """`offer` each of `items`, which share `key`."""
        if self.key is None or key > self.key:
            self.key, self.items = key, list(items)
        elif key == self.key:
            self.items += items


def share_fits(req: MLRequirements, caps: Capabilities, free: tuple[int, ...] | None) -> bool:
    """Whether a share job fits a device now: sharing on (`free` reported), its milli-GPU
    known there (a VRAM share needs `gpu.memory_gb`) and some device with that much left."""
    milli = share_milli(req, caps)
    return free is not None and milli is not None and pick_share(free, milli) is not None


def wants_link(req: MLRequirements) -> bool:
    """Whether the job's GPUs must be NVLink peers of each other (§3.2 `nvlink`, 2+ GPUs)."""
    return (
        req.ext_ml_gpu_interconnect == "nvlink"
        and (req.ext_ml_gpu_count or 0) > 1
        and gpu_share(req) is None
    )
