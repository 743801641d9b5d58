"""Detect this machine's capabilities: GPUs through NVML, the rest through psutil.

With `runtimes.installed_runtimes` (module and binary look-ups), the only code of the
layer that does I/O. NVML and psutil are injectable, so tests run the real code against
`celery_ojs_ml.testing.fake_nvml.FakeNVML`.

Key decision: the worker never claims more than it has. No driver, no devices or an
NVML failure give a clean CPU-only result (probing never raises); sizes are GiB
floored to 0.1, except a well-known GPU's VRAM, snapped to its catalogue variant
(`vram_gb`); and a host whose devices differ (two models, MIG) advertises each
device's facts (`capabilities.devices`), so no job is promised N GPUs of a type it
has fewer of.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from celery_ojs_ml.capabilities.devices import GpuDevice as GpuDevice
from celery_ojs_ml.capabilities.devices import differ, facts_of, most_common_type
from celery_ojs_ml.capabilities.links import largest_peer_set
from celery_ojs_ml.capabilities.mig import mig_devices
from celery_ojs_ml.capabilities.model import VRAM_SNAP, Capabilities, GpuCapability
from celery_ojs_ml.capabilities.runtimes import installed_runtimes
from celery_ojs_ml.spec.catalogue import GPU_MODELS, gpu_model

GIB = 1024**3
T = TypeVar("T")

_BRAND_WORDS = frozenset({"nvidia", "tesla", "geforce", "quadro"})
_PACKAGING = re.compile(r"^(\d+gb|sxm\d*|pcie|hbm\d*e?|nvl|mig.*)$")


class _NeverRaised(Exception):
    """Stands in for NVMLError when the injected module has none."""


def gib_floor(n_bytes: float) -> float:
    """Bytes as GiB, floored to one decimal so the value never overclaims."""
    return math.floor(n_bytes / GIB * 10) / 10


def gpu_type_from_name(name: str) -> str:
    """The §3.2 id for an NVML marketing name (`Tesla T4` -> `nvidia-t4`).

    Names outside the catalogue become `nvidia-<model words>` without brand and
    packaging words: `NVIDIA GeForce RTX 4090` -> `nvidia-rtx-4090`.
    """
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    for word in words:
        if f"nvidia-{word}" in GPU_MODELS:
            return f"nvidia-{word}"
    model = [w for w in words if w not in _BRAND_WORDS and not _PACKAGING.match(w)]
    return "nvidia-" + "-".join(model or ["unknown"])


def vram_gb(gpu_type: str, n_bytes: float) -> float:
    """VRAM of one device: the nearest catalogue variant within 10%, else floored GiB.

    The catalogue speaks in marketing GB (an "80 GB" H100 reports 79.6 GiB, a "16 GB"
    T4 15.0 GiB, a "24 GB" L4 22.5 GiB), and a job sized by the catalogue must still
    match.
    """
    reading = n_bytes / GIB
    row = gpu_model(gpu_type)
    if row is not None:
        nearest = min(row.memory_gb, key=lambda v: abs(reading - v))
        if abs(reading - nearest) <= nearest * VRAM_SNAP:
            return float(nearest)
    return gib_floor(n_bytes)


def visible_tokens(env: dict[str, str] | None = None) -> list[str] | None:
    """The devices this process may use, as the environment names them; None: all.

    `CUDA_VISIBLE_DEVICES` (indices or UUIDs, in CUDA's order) wins. Else
    `NVIDIA_VISIBLE_DEVICES` counts only when it lists UUIDs: indices there are
    the container runtime's, which has already renumbered what NVML sees.
    """
    import os

    env = dict(os.environ) if env is None else env
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [t.strip() for t in cvd.split(",") if t.strip()]
    nvd = env.get("NVIDIA_VISIBLE_DEVICES", "")
    tokens = [t.strip() for t in nvd.split(",") if t.strip()]
    if tokens and all(t.startswith(("GPU-", "MIG-")) for t in tokens):
        return tokens
    return None


def select_visible(devices: list[GpuDevice], tokens: list[str] | None) -> list[GpuDevice]:
    """The devices `tokens` name, in their order (CUDA numbers them 0.. in that order)."""
    return [d for _, d in _named(devices, tokens)]


def _named(devices: list[GpuDevice], tokens: list[str] | None) -> list[tuple[str, GpuDevice]]:
    """(token, device) for each device `tokens` names, in their order; None: every device,
    named by its NVML index."""
    if tokens is None:
        return [(d.token, d) for d in devices]
    by_name = {str(d.index): d for d in devices if not d.mig}
    by_name |= {d.uuid: d for d in devices if d.uuid}
    return [(t, by_name[t]) for t in tokens if t in by_name]


def probe_devices(
    nvml: Any | None = None, visible: list[str] | bool | None = True
) -> list[GpuDevice]:
    """The GPUs NVML sees that this process may use (`visible_tokens`), in CUDA's order;
    [] when there is none or no NVML. `visible=True` reads the environment."""
    module = _load_nvml(nvml)
    if module is None:
        return []
    errors = _nvml_errors(module)
    try:
        module.nvmlInit()
    except errors:
        return []
    try:
        found = _read_devices(module, errors)
    except errors:
        return []
    finally:
        _shutdown(module, errors)
    tokens = visible_tokens() if visible is True else visible or None
    return select_visible(found, tokens)


def advertised_tokens(
    nvml: Any | None = None, env: dict[str, str] | None = None
) -> list[str] | None:
    """How the worker's allocation indices name devices.

    On a host of alike devices this is `visible_tokens` (None: index i is
    device i). Where they differ (two models, MIG) allocation index i is the
    i-th device the worker advertises (`Capabilities.gpu_devices`), named as
    CUDA_VISIBLE_DEVICES names it: the inherited token, else the NVML index
    (which `CUDA_DEVICE_ORDER=PCI_BUS_ID` makes CUDA's), a MIG device's UUID.
    """
    tokens, pairs, mixed = _advertised(nvml, env)
    return [t for t, _ in pairs] if mixed else tokens


def advertised_peers(
    nvml: Any | None = None, env: dict[str, str] | None = None
) -> list[frozenset[int]] | None:
    """NVLink peers of each allocation index, as allocation indices; None when unknown."""
    _, pairs, _ = _advertised(nvml, env)
    return _local_peers([d for _, d in pairs])


def _local_peers(devices: list[GpuDevice]) -> list[frozenset[int]] | None:
    """Each device's NVLink peers as positions in `devices`; None when empty or unknown."""
    if not devices or any(d.peers is None for d in devices):
        return None
    return [
        frozenset(q for q, other in enumerate(devices) if other.index in (d.peers or ()))
        for d in devices
    ]


def _advertised(
    nvml: Any | None, env: dict[str, str] | None
) -> tuple[list[str] | None, list[tuple[str, GpuDevice]], bool]:
    """The visible tokens, (token, device) in allocation order, and whether the devices
    differ (then the tokens are named explicitly)."""
    tokens = visible_tokens(env)
    pairs = _named(probe_devices(nvml, visible=False), tokens)
    return tokens, pairs, differ([d for _, d in pairs])


def probe(
    *,
    nvml: Any | None = None,
    psutil_mod: Any | None = None,
    shm_path: str = "/dev/shm",
    disk_path: str = "/",
    runtimes: Sequence[str] | None = None,
) -> Capabilities:
    """This machine's capabilities; CPU-only (never an exception) without GPUs.
    `runtimes`: the §11 runtimes to advertise; None finds them (`installed_runtimes`)."""
    devices = probe_devices(nvml)
    gpu, labels = summarise_gpus(devices)
    host = _host(psutil_mod, shm_path, disk_path)
    found = installed_runtimes() if runtimes is None else tuple(runtimes)
    facts = facts_of(devices) if differ(devices) else ()
    doc = {"gpu": gpu, "labels": labels, "runtimes": found, "gpu_devices": facts, **host}
    return Capabilities.model_validate(doc)


def summarise_gpus(devices: list[GpuDevice]) -> tuple[GpuCapability | None, dict[str, str]]:
    """The advertised `gpu` object and mix labels for a list of devices.

    `gpu` counts every device. Mixed GPUs: its type and compute capability are the
    most common model's (ties: the model of the lowest index), its VRAM the
    smallest device's; `gpu_heterogeneous = "true"` and `gpu_types` record the
    mix, `gpu_mig = "true"` MIG devices, and `Capabilities.gpu_devices` each
    device's facts (`capabilities.devices`).
    """
    if not devices:
        return None, {}
    counts = Counter(d.gpu_type for d in devices)
    gpu_type = most_common_type(devices) or ""
    labels = {}
    if len(counts) > 1:
        labels = {"gpu_heterogeneous": "true", "gpu_types": ",".join(sorted(counts))}
    if any(d.mig for d in devices):
        labels["gpu_mig"] = "true"
    return _gpu_of(gpu_type, devices, [d for d in devices if d.gpu_type == gpu_type]), labels


def _gpu_of(gpu_type: str, group: list[GpuDevice], models: list[GpuDevice]) -> GpuCapability:
    """The `gpu` object of `group`, with the compute capability of `models` (its
    devices of `gpu_type`, as the §3.2 catalogue has it).

    Interconnect is `nvlink` when at least two devices are NVLink peers (NVML's P2P
    status; without it, when any device has an active NVLink link), `pcie` otherwise,
    unset for a single GPU (§3.2). When the peers form smaller islands (bridged
    pairs), `nvlink_group` says how many devices one job can get all linked.
    """
    ccs = [d.compute_capability for d in models if d.compute_capability]
    complete = len(ccs) == len(models)
    interconnect, linked = None, _linked(group)
    if len(group) > 1:
        nvlink = any(d.nvlink for d in group) if linked is None else linked >= 2
        interconnect = "nvlink" if nvlink else "pcie"
    return GpuCapability.model_validate(
        {
            "type": gpu_type,
            "count": len(group),
            "memory_gb": min(d.memory_gb for d in group),
            "compute_capability": _lowest_cc(ccs) if complete else None,
            "interconnect": interconnect,
            "nvlink_group": linked if linked and 2 <= linked < len(group) else None,
        }
    )


def _linked(group: list[GpuDevice]) -> int | None:
    """The most devices of `group` that are all NVLink peers; None when peers are unknown."""
    peers = _local_peers(group)
    return None if peers is None else largest_peer_set(range(len(group)), peers)


def _lowest_cc(ccs: list[str]) -> str:
    return min(ccs, key=lambda cc: tuple(int(p) for p in cc.split(".")))


def _load_nvml(nvml: Any | None) -> Any | None:
    if nvml is not None:
        return nvml
    try:
        import pynvml
    except (ImportError, OSError):
        return None
    return pynvml


def _nvml_errors(module: Any) -> tuple[type[BaseException], ...]:
    nvml_error = getattr(module, "NVMLError", _NeverRaised)
    return (nvml_error, ImportError, OSError)


def _shutdown(module: Any, errors: tuple[type[BaseException], ...]) -> None:
    with contextlib.suppress(*errors):
        module.nvmlShutdown()


def _read_devices(module: Any, errors: tuple[type[BaseException], ...]) -> list[GpuDevice]:
    read: list[tuple[GpuDevice, Any]] = []
    for index in range(module.nvmlDeviceGetCount()):
        try:
            read.append(_read_device(module, index, errors))
        except errors:
            continue
    peers = _nvlink_peers(module, read, errors)
    found: list[GpuDevice] = []
    for device, handle in read:
        device = replace(device, peers=None if peers is None else peers[device.index])
        migs = mig_devices(module, device, handle, errors, gib_floor)  # capabilities.mig
        found += [device] if migs is None else migs
    return found


def _nvlink_peers(
    module: Any, read: list[tuple[GpuDevice, Any]], errors: tuple[type[BaseException], ...]
) -> dict[int, frozenset[int]] | None:
    """Each device's NVLink peers by NVML's P2P status (NVSwitch boards included)."""
    status = getattr(module, "nvmlDeviceGetP2PStatus", None)
    if status is None:
        return None
    cap = getattr(module, "NVML_P2P_CAPS_INDEX_NVLINK", 3)
    ok = getattr(module, "NVML_P2P_STATUS_OK", 0)
    peers: dict[int, set[int]] = {d.index: set() for d, _ in read}
    try:
        for (a, ha), (b, hb) in itertools.combinations(read, 2):
            if status(ha, hb, cap) == ok:
                peers[a.index].add(b.index)
                peers[b.index].add(a.index)
    except errors:
        return None
    return {i: frozenset(p) for i, p in peers.items()}


def _read_device(
    module: Any, index: int, errors: tuple[type[BaseException], ...]
) -> tuple[GpuDevice, Any]:
    handle = module.nvmlDeviceGetHandleByIndex(index)
    name = _text(module.nvmlDeviceGetName(handle))
    gpu_type = gpu_type_from_name(name)
    total = module.nvmlDeviceGetMemoryInfo(handle).total
    device = GpuDevice(
        index=index,
        name=name,
        uuid=_optional(lambda: _text(module.nvmlDeviceGetUUID(handle)), errors),
        gpu_type=gpu_type,
        memory_gb=vram_gb(gpu_type, total),
        compute_capability=_optional(lambda: _cc(module, handle), errors),
        nvlink=_has_nvlink(module, handle, errors),
    )
    return device, handle


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _cc(module: Any, handle: Any) -> str:
    major, minor = module.nvmlDeviceGetCudaComputeCapability(handle)
    return f"{major}.{minor}"


def _optional(read: Callable[[], T], errors: tuple[type[BaseException], ...]) -> T | None:
    try:
        return read()
    except errors:
        return None


def _has_nvlink(module: Any, handle: Any, errors: tuple[type[BaseException], ...]) -> bool:
    enabled = getattr(module, "NVML_FEATURE_ENABLED", 1)
    for link in range(getattr(module, "NVML_NVLINK_MAX_LINKS", 0)):
        try:
            if module.nvmlDeviceGetNvLinkState(handle, link) == enabled:
                return True
        except errors:
            continue
    return False


def _host(psutil_mod: Any | None, shm_path: str, disk_path: str) -> dict[str, Any]:
    """CPU cores, host memory, free scratch disk and /dev/shm size."""
    ps = psutil_mod if psutil_mod is not None else _import_psutil()
    if ps is None:
        return {}
    return {
        "cpu_cores": ps.cpu_count(logical=True) or None,
        "memory_gb": gib_floor(ps.virtual_memory().total),
        "storage_gb": _disk(ps, disk_path, "free"),
        "shm_size_gb": _disk(ps, shm_path, "total"),
    }


def _import_psutil() -> Any | None:
    try:
        import psutil
    except ImportError:
        return None
    return psutil


def _disk(ps: Any, path: str, attribute: str) -> float | None:
    try:
        return gib_floor(getattr(ps.disk_usage(path), attribute))
    except OSError:
        return None
