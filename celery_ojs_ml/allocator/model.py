"""The allocator's values: counted demand, allocations, held and denied requests.

Key decision: a request's footprint is a `Demand` of four counted resources
(GPUs, CPU cores, memory, TPU chips). Anything a job does not ask for counts as
zero, so a GPU job that omits `ext_ml_cpu_cores` takes no counted cores; only
GPUs are pinned to device indices, the rest are plain counts.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.errors import OJSMLError
from celery_ojs_ml.matching import Reason
from celery_ojs_ml.spec.catalogue import priority_rank
from celery_ojs_ml.spec.classes import band as band_of
from celery_ojs_ml.spec.resources import MLRequirements, gpu_share

#: Wire names of the counted resources, as matching's reasons spell them.
RESOURCE_NAMES = {
    "gpus": "gpu_count",
    "cpu_cores": "cpu_cores",
    "memory_gb": "memory_gb",
    "tpu_chips": "tpu_chip_count",
}


class AllocatorError(OJSMLError, ValueError):
    """The caller broke the allocation protocol (e.g. a key allocated or held twice)."""


@dataclass(frozen=True, slots=True)
class Demand:
    """Counted resources: what a job takes, or what a worker has free or in total."""

    gpus: int = 0
    cpu_cores: float = 0
    memory_gb: float = 0
    tpu_chips: int = 0

    @classmethod
    def of(cls, req: MLRequirements) -> Demand:
        """A request's footprint; attributes it leaves out count as 0 (see module doc).

        A GPU share (`ojs_ml_gpu_share`) counts no whole GPU: its milli-GPU are
        accounted per device (`allocator.sharing`).
        """
        return cls(
            0 if gpu_share(req) is not None else req.ext_ml_gpu_count or 0,
            req.ext_ml_cpu_cores or 0,
            req.ext_ml_memory_gb or 0,
            req.ext_ml_tpu_chip_count or 0,
        )

    @classmethod
    def capacity(cls, caps: Capabilities, reserve_cpu: float, reserve_memory_gb: float) -> Demand:
        """What a worker can hand out: its totals less what is reserved for the host."""
        return cls(
            caps.gpu_count,
            max(0.0, (caps.cpu_cores or 0) - reserve_cpu),
            max(0.0, (caps.memory_gb or 0) - reserve_memory_gb),
            caps.tpu.chip_count if caps.tpu else 0,
        )

    @classmethod
    def total(cls, demands: Iterable[Demand]) -> Demand:
        """The sum of many demands (recomputed, so no float drift accumulates)."""
        out = cls()
        for d in demands:
            out = out.plus(d)
        return out

    def items(self) -> list[tuple[str, float]]:
        """(field name, amount) for each counted resource, in a fixed order."""
        return [
            ("gpus", self.gpus),
            ("cpu_cores", self.cpu_cores),
            ("memory_gb", self.memory_gb),
            ("tpu_chips", self.tpu_chips),
        ]

    def plus(self, other: Demand) -> Demand:
        """Element-wise sum."""
        return Demand(
            self.gpus + other.gpus,
            self.cpu_cores + other.cpu_cores,
            self.memory_gb + other.memory_gb,
            self.tpu_chips + other.tpu_chips,
        )

    def minus(self, other: Demand) -> Demand:
        """Element-wise difference, floored at zero."""
        return Demand(
            max(self.gpus - other.gpus, 0),
            max(self.cpu_cores - other.cpu_cores, 0),
            max(self.memory_gb - other.memory_gb, 0),
            max(self.tpu_chips - other.tpu_chips, 0),
        )

    def short_of(self, free: Demand) -> list[str]:
        """Field names of the resources this demand uses and `free` cannot cover."""
        return [
            name
            for name, want, have in (
                ("gpus", self.gpus, free.gpus),
                ("cpu_cores", self.cpu_cores, free.cpu_cores),
                ("memory_gb", self.memory_gb, free.memory_gb),
                ("tpu_chips", self.tpu_chips, free.tpu_chips),
            )
            if want > 0 and want > have
        ]


def rank(band: str) -> int:
    """§8.1 rank of a band: reserved (2) > on-demand (1) > spot (0)."""
    return priority_rank(band)


def preemptible_of(req: MLRequirements) -> bool:
    """§8.2: the job's own flag, else true only for spot (normalize usually sets it)."""
    if req.ext_ml_preemptible is not None:
        return req.ext_ml_preemptible
    return band_of(req) == "spot"


@dataclass(frozen=True, slots=True)
class Allocation:
    """A running job's resources (RFC 27 alloc SUCCESS): pinned GPUs plus counts."""

    key: Hashable
    task_id: str
    devices: tuple[int, ...]
    cpu_cores: float
    memory_gb: float
    tpu_chips: int
    band: str
    preemptible: bool
    started_at: float
    gpu_milli: int = 0
    """A GPU share's milli-GPU on its one device (`allocator.sharing`); 0: whole devices."""

    @property
    def demand(self) -> Demand:
        """The counted resources this allocation holds (a share holds no whole GPU)."""
        gpus = 0 if self.gpu_milli else len(self.devices)
        return Demand(gpus, self.cpu_cores, self.memory_gb, self.tpu_chips)

    def as_dict(self) -> dict[str, Any]:
        """JSON form for `inspect stats`, Flower and `celery ojs-ml status`."""
        return {
            "task_id": self.task_id,
            "devices": list(self.devices),
            "cpu_cores": self.cpu_cores,
            "memory_gb": self.memory_gb,
            "tpu_chips": self.tpu_chips,
            "band": self.band,
            "preemptible": self.preemptible,
            "started_at": self.started_at,
            **({"gpu_milli": self.gpu_milli} if self.gpu_milli else {}),
        }


@dataclass
class Pending:
    """A held request and why it waits (RFC 27 ANNOTATE `sched.reason_pending`).

    Mutable on purpose: `pump` re-annotates `reason` and `prioritise` changes
    `priority` while the request stays queued.
    """

    key: Hashable
    task_id: str
    req: MLRequirements
    band: str
    priority: int
    since: float
    reason: str
    labels: Mapping[str, str] = field(default_factory=dict)
    """The job's own labels, matched by other jobs' anti-affinity (§7.3) once it runs."""

    def as_dict(self) -> dict[str, Any]:
        """JSON form for `inspect stats`, Flower and `celery ojs-ml status`."""
        return {
            "task_id": self.task_id,
            "band": self.band,
            "priority": self.priority,
            "since": self.since,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class Denied:
    """RFC 27 DENY: this worker can never run the request; `reason` is the note."""

    key: Hashable
    task_id: str
    reason: str
    reasons: tuple[Reason, ...] = ()
    """The structured NEVER reasons behind `reason`."""
