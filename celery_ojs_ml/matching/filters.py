"""Hard-constraint filters: can this worker run this job, now, later or never?

Key decision (after the Kubernetes scheduler framework): each filter is a small
pure function that returns structured reasons, never a bare bool, and each
reason says whether it can resolve itself. Totals decide NEVER; free capacity
decides WAIT. The verdict of a match is the worst reason's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.capabilities.devices import job_gpu
from celery_ojs_ml.capabilities.model import GpuCapability
from celery_ojs_ml.capabilities.runtimes import formats_of, runtimes_of
from celery_ojs_ml.spec.catalogue import cc_tuple
from celery_ojs_ml.spec.resources import AffinityRule, MLRequirements, gpu_share


class Verdict(Enum):
    """FITS now, WAIT until running work frees resources, or NEVER on this worker."""

    FITS = "FITS"
    WAIT = "WAIT"
    NEVER = "NEVER"


@dataclass(frozen=True, slots=True)
class Reason:
    """One failed constraint: what, how much was asked, free now, and in total."""

    resource: str
    requested: Any
    available: Any
    capacity: Any
    verdict: Verdict
    template: str

    @property
    def message(self) -> str:
        """The reason as users read it, e.g. `gpu_memory_gb 40 < 80` (formatted lazily)."""
        return self.template.format(a=fmt(self.available), r=fmt(self.requested))

    def as_dict(self) -> dict[str, Any]:
        """JSON form used by the CLI, events and the store."""
        return {
            "resource": self.resource,
            "requested": self.requested,
            "available": self.available,
            "capacity": self.capacity,
            "verdict": self.verdict.value,
            "message": self.message,
        }


@dataclass(frozen=True, slots=True)
class FreeCapacity:
    """What a worker has free right now; None means the resource is not tracked."""

    gpus: int | None = None
    cpu_cores: float | None = None
    memory_gb: float | None = None
    tpu_chips: int | None = None
    running_labels: tuple[Mapping[str, str], ...] = field(default=())
    reservations: frozenset[str] = frozenset()
    """Ids of the dynamic reservations (`ml.reserve`) this worker holds now (§8.3)."""
    processes: int | None = None
    """Pool processes free for another job (every job runs in one; negative: jobs
    wait in the pool's queue), as the fleet scheduler counts them to prefer a worker
    that can start a job at once; None: not tracked. Never a reason to wait."""


Filter = Callable[[MLRequirements, Capabilities, FreeCapacity | None], Iterator[Reason]]


def fmt(value: Any) -> str:
    """A number or value as users see it: 80 not 80.0."""
    if value is None:
        return "unknown"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list | tuple | frozenset | set):
        return "[" + ", ".join(sorted(str(v) for v in value)) + "]"
    return str(value)


def _never(resource: str, requested: Any, capacity: Any, template: str) -> Reason:
    return Reason(resource, requested, capacity, capacity, Verdict.NEVER, template)


def _lit(text: str) -> str:
    """Escape a pre-formatted message so the lazy formatter leaves it alone."""
    return text.replace("{", "{{").replace("}", "}}")


def _counted(
    resource: str, requested: float | None, capacity: float | None, free: float | None
) -> Iterator[Reason]:
    """A consumable resource: NEVER over the total, WAIT over what is free now."""
    if requested is None or requested <= 0:
        return
    total = capacity or 0
    if requested > total:
        # NEVER is about the total, so say the total even when `available` is what is free.
        msg = resource + " " + _lit(fmt(total)) + " < {r}"
        yield Reason(
            resource, requested, free if free is not None else total, total, Verdict.NEVER, msg
        )
    elif free is not None and requested > free:
        msg = resource + " free {a} < {r}"
        yield Reason(resource, requested, free, total, Verdict.WAIT, msg)


def accelerator(
    req: MLRequirements, w: Capabilities, free: FreeCapacity | None
) -> Iterator[Reason]:
    """§3.1: a GPU or TPU job never goes to a worker without that accelerator."""
    want = req.ext_ml_accelerator
    if want == "gpu" and w.gpu_count == 0:
        yield _never("accelerator", "gpu", w.accelerator, "accelerator {a} != {r}")
    elif want == "tpu" and w.tpu is None:
        yield _never("accelerator", "tpu", w.accelerator, "accelerator {a} != {r}")
    elif want == "fpga" and w.accelerator != "fpga":
        yield _never("accelerator", "fpga", w.accelerator, "accelerator {a} != {r}")


def gpu(req: MLRequirements, w: Capabilities, free: FreeCapacity | None) -> Iterator[Reason]:
    """§3.2/§11: GPU type, VRAM, compute capability, interconnect, then count."""
    count = req.ext_ml_gpu_count or 0
    if count == 0 or w.gpu is None or w.gpu_count == 0:
        return
    # a host whose devices differ: the devices that can serve the job (capabilities.devices)
    g = job_gpu(w, count, req.ext_ml_gpu_type, req.ext_ml_gpu_memory_gb,
                req.ext_ml_gpu_compute_capability) or w.gpu  # fmt: skip
    if req.ext_ml_gpu_type and g.type != req.ext_ml_gpu_type:
        yield _never("gpu_type", req.ext_ml_gpu_type, g.type, "gpu_type {a} not in [{r}]")
    mem = req.ext_ml_gpu_memory_gb
    if mem is not None and (g.memory_gb or 0) < mem:
        yield _never("gpu_memory_gb", mem, g.memory_gb, "gpu_memory_gb {a} < {r}")
    cc = req.ext_ml_gpu_compute_capability
    if cc is not None and (
        g.compute_capability is None or cc_tuple(g.compute_capability) < cc_tuple(cc)
    ):
        yield _never("compute_capability", cc, g.compute_capability, "compute_capability {a} < {r}")
    if req.ext_ml_gpu_interconnect == "nvlink":
        yield from _nvlink(count, g)
    # A share (`ojs_ml_gpu_share`) needs milli-GPU on one device, not a whole free GPU:
    # the allocator and the scheduler's fit check judge that per device.
    shared = gpu_share(req) is not None
    free_gpus = min(free.gpus, g.count) if free and free.gpus is not None and not shared else None
    yield from _counted("gpu_count", count, g.count, free_gpus)


def _nvlink(count: int, g: GpuCapability) -> Iterator[Reason]:
    """§3.2 `ext_ml_gpu_interconnect: nvlink`: the GPUs must be NVLink peers."""
    if count > 1 and g.interconnect != "nvlink":
        yield _never("gpu_interconnect", "nvlink", g.interconnect, "gpu_interconnect {a} != {r}")
    elif g.nvlink_group and count > g.nvlink_group:
        why = "gpu_interconnect: NVLink-peer GPUs {a} < {r}"
        yield _never("gpu_interconnect", count, g.nvlink_group, why)


def tpu(req: MLRequirements, w: Capabilities, free: FreeCapacity | None) -> Iterator[Reason]:
    """§3.3: TPU type, a slice of the requested topology, and the chip count."""
    if req.ext_ml_accelerator != "tpu" or w.tpu is None:
        return
    t = w.tpu
    if req.ext_ml_tpu_type and t.type != req.ext_ml_tpu_type:
        yield _never(
            "tpu_type",
            req.ext_ml_tpu_type,
            t.type,
            "tpu_type {a} not in [{r}]",
        )
    topo = req.ext_ml_tpu_topology
    if topo and not _slice_fits(topo, t.topology):
        yield _never(
            "tpu_topology",
            topo,
            t.topology,
            "tpu_topology {a} cannot hold {r}",
        )
    chips = req.ext_ml_tpu_chip_count
    yield from _counted("tpu_chip_count", chips, t.chip_count, free.tpu_chips if free else None)


def _slice_fits(want: str, have: str | None) -> bool:
    if have is None:
        return False
    a, b = [int(x) for x in want.split("x")], [int(x) for x in have.split("x")]
    return len(a) == len(b) and all(x <= y for x, y in zip(sorted(a), sorted(b), strict=True))


def host(req: MLRequirements, w: Capabilities, free: FreeCapacity | None) -> Iterator[Reason]:
    """§3.4-§3.5, v0.1 §6.2: CPU cores and memory are counted; storage and shm are minimums."""
    yield from _counted(
        "cpu_cores", req.ext_ml_cpu_cores, w.cpu_cores, free.cpu_cores if free else None
    )
    yield from _counted(
        "memory_gb", req.ext_ml_memory_gb, w.memory_gb, free.memory_gb if free else None
    )
    for resource, want, have in (
        ("storage_gb", req.ext_ml_storage_gb, w.storage_gb),
        ("shm_size_gb", req.ext_ml_shm_size_gb, w.shm_size_gb),
    ):
        if want and (have or 0) < want:
            yield _never(resource, want, have, resource + " {a} < {r}")


def node_selector(
    req: MLRequirements, w: Capabilities, free: FreeCapacity | None
) -> Iterator[Reason]:
    """§7.1: every selector label must equal the worker's label."""
    labels = w.derived_labels()
    for key, value in (req.ext_ml_node_selector or {}).items():
        have = labels.get(key)
        if have != value:
            yield _never(
                f"label:{key}",
                value,
                have,
                _lit(f"{key} {have if have is not None else '<unset>'} != {value}"),
            )


def affinity(req: MLRequirements, w: Capabilities, free: FreeCapacity | None) -> Iterator[Reason]:
    """§7.2: every required rule must hold on the worker's labels."""
    if req.ext_ml_affinity is None:
        return
    labels = w.derived_labels()
    for rule in req.ext_ml_affinity.required:
        if not rule_holds(rule, labels):
            have = labels.get(rule.key)
            yield _never(
                f"label:{rule.key}",
                describe(rule),
                have,
                _lit(
                    f"{rule.key} {have if have is not None else '<unset>'} fails {describe(rule)}"
                ),
            )


def anti_affinity(
    req: MLRequirements, w: Capabilities, free: FreeCapacity | None
) -> Iterator[Reason]:
    """§7.3: a rule that holds on the worker is NEVER; on a running job there, WAIT."""
    if req.ext_ml_anti_affinity is None:
        return
    labels = w.derived_labels()
    running = free.running_labels if free else ()
    for rule in req.ext_ml_anti_affinity.required:
        if rule.key in labels and rule_holds(rule, labels):
            yield _never(
                f"anti:{rule.key}",
                describe(rule),
                labels.get(rule.key),
                _lit(f"anti-affinity {describe(rule)} holds on the worker"),
            )
        elif any(rule.key in r and rule_holds(rule, r) for r in running):
            yield Reason(
                f"anti:{rule.key}",
                describe(rule),
                "running",
                None,
                Verdict.WAIT,
                _lit(f"anti-affinity {describe(rule)} holds on a running job"),
            )


def model_version(
    req: MLRequirements, w: Capabilities, free: FreeCapacity | None
) -> Iterator[Reason]:
    """§4: with id and version set, the worker must have that version loaded or reachable."""
    mid, ver = req.ext_ml_model_id, req.ext_ml_model_version
    if not (mid and ver) or w.model_registry_access:
        return
    if not any(m.model_id == mid and m.model_version == ver for m in w.models_loaded):
        yield _never("model", f"{mid}@{ver}", None, "model {r} not loaded")


def runtime(req: MLRequirements, w: Capabilities, free: FreeCapacity | None) -> Iterator[Reason]:
    """§6, §11: the worker advertises the job's `ext_ml_runtime` (aliases such as `torch`
    count, `capabilities.runtimes`). A worker that advertises no runtime at all has not
    said (`runtimes` is optional in §11, and §11's hard-constraint list omits it): it is
    not refused on this ground."""
    want = req.ext_ml_runtime
    if want is not None and (have := runtimes_of(w)) and want not in have:
        yield _never("runtime", want, tuple(sorted(have)), "runtime {r} not in {a}")


def model_format(
    req: MLRequirements, w: Capabilities, free: FreeCapacity | None
) -> Iterator[Reason]:
    """§4: the worker loads the job's `ext_ml_model_format`: one of its runtimes does
    (`RUNTIME_FORMATS`), a model of that format is loaded, or it declares the format. A
    worker that names no runtime, format or loaded model's format has not said."""
    want = req.ext_ml_model_format
    if want is not None and (have := formats_of(w)) and want not in have:
        yield _never("model_format", want, tuple(sorted(have)), "model_format {r} not in {a}")


def reservation(
    req: MLRequirements, w: Capabilities, free: FreeCapacity | None
) -> Iterator[Reason]:
    """§8.3: a reserved job runs only inside its reservation's pool.

    The pool is a worker labelled `reservation_id` (a static reservation) or a
    dynamic reservation (`ml.reserve`) the worker holds now.
    """
    rid = req.ext_ml_reservation_id
    if rid is None:
        return
    have = w.derived_labels().get("reservation_id")
    if have != rid and not (free is not None and rid in free.reservations):
        yield _never(
            "reservation_id", rid, have, _lit(f"reservation_id {have or '<unset>'} != {rid}")
        )


def describe(rule: AffinityRule) -> str:
    """A rule as users read it: `gpu_type In [nvidia-a100]`."""
    if not rule.values:
        return f"{rule.key} {rule.operator}"
    return f"{rule.key} {rule.operator} {fmt(rule.values)}"


def rule_holds(rule: AffinityRule, labels: Mapping[str, str]) -> bool:
    """Evaluate one §7.2 operator against a label map."""
    op, value = rule.operator, labels.get(rule.key)
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op == "NotIn":
        return value is None or value not in rule.values
    if value is None:
        return False
    if op == "In":
        return value in rule.values
    return _compare(op, rule.key, value, rule.values[0])


def _compare(op: str, key: str, have: str, want: str) -> bool:
    try:
        a: tuple[float, ...] = cc_tuple(have) if key == "compute_capability" else (float(have),)
        b: tuple[float, ...] = cc_tuple(want) if key == "compute_capability" else (float(want),)
    except ValueError:
        return False
    return {"Gt": a > b, "Gte": a >= b, "Lt": a < b, "Lte": a <= b}[op]


FILTERS: tuple[Filter, ...] = (
    accelerator,
    gpu,
    tpu,
    host,
    node_selector,
    affinity,
    anti_affinity,
    model_version,
    runtime,
    model_format,
    reservation,
)
