"""A fake of the pynvml functions the capability probe calls.

Lets the real probe run on a machine without a GPU or driver. Devices are
plain values; the presets carry the memory totals real boards report (an
"80 GB" H100 reports 81559 MiB), so tests exercise the VRAM snapping on the
numbers production sees. `mixed_host()` is a host of two models, `mig_host()`
one whose first GPU is in MIG mode (`nvmlDeviceGetMigMode`,
`nvmlDeviceGetMaxMigDeviceCount`, `nvmlDeviceGetMigDeviceHandleByIndex`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace

MIB = 1024**2


class NVMLError(Exception):
    """The fake's stand-in for `pynvml.NVMLError`."""


@dataclass(frozen=True, slots=True)
class FakeGpu:
    """One simulated device: marketing name, memory in bytes, cc, active NVLink links."""

    name: str
    memory_bytes: int
    cc: tuple[int, int]
    nvlink_links: int = 0
    uuid: str | None = None
    mig: tuple[FakeGpu | None, ...] | None = None
    """MIG mode on, with these MIG devices in its slots (None: an empty slot); None: the
    GPU has no MIG mode (NVML says "Not Supported")."""


A100_80GB = FakeGpu("NVIDIA A100-SXM4-80GB", 81920 * MIB, (8, 0), nvlink_links=12)
A100_40GB = FakeGpu("NVIDIA A100-PCIE-40GB", 40960 * MIB, (8, 0))
H100_80GB = FakeGpu("NVIDIA H100 80GB HBM3", 81559 * MIB, (9, 0), nvlink_links=18)
T4 = FakeGpu("Tesla T4", 15360 * MIB, (7, 5))
L4 = FakeGpu("NVIDIA L4", 23034 * MIB, (8, 9))
A10G = FakeGpu("NVIDIA A10G", 23028 * MIB, (8, 6))
RTX_4090 = FakeGpu("NVIDIA GeForce RTX 4090", 24564 * MIB, (8, 9))


def mig_slice(profile: str, mib: int, gpu: int, slot: int) -> FakeGpu:
    """A MIG device of an A100 80GB, e.g. `mig_slice("3g.40gb", 40192, 0, 0)`."""
    name = f"NVIDIA A100-SXM4-80GB MIG {profile}"
    return FakeGpu(name, mib * MIB, (8, 0), uuid=f"MIG-fake-{gpu:02d}-{slot:02d}")


def mixed_host() -> FakeNVML:
    """NVML order: A100 80GB, A100 80GB, T4, A100 80GB (the T4 is the minority model)."""
    a100 = FakeNVML.of(A100_80GB, 4).devices
    t4 = replace(T4, uuid="GPU-fake-0002")
    return FakeNVML([a100[0], a100[1], t4, a100[3]])


def mig_host() -> FakeNVML:
    """GPU 0 in MIG mode as a 3g.40gb and two 1g.10gb devices (slot 2 empty), GPU 1 whole."""
    slots = (
        mig_slice("3g.40gb", 40192, 0, 0),
        mig_slice("1g.10gb", 9856, 0, 1),
        None,
        mig_slice("1g.10gb", 9856, 0, 3),
    )
    gpus = FakeNVML.of(A100_80GB, 2).devices
    return FakeNVML([replace(gpus[0], mig=slots, nvlink_links=0), replace(gpus[1], nvlink_links=0)])


class FakeNVML:
    """Stands in for the `pynvml` module; pass it as `probe(nvml=...)`.

    `driver=False` makes `nvmlInit` raise `NVMLError` as on a machine without
    the NVIDIA driver; `init_error` raises any other exception type instead.
    """

    NVMLError = NVMLError
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_DISABLED = 0
    NVML_FEATURE_ENABLED = 1
    NVML_P2P_CAPS_INDEX_NVLINK = 3
    NVML_P2P_STATUS_OK = 0
    NVML_P2P_STATUS_NOT_SUPPORTED = 5
    NVML_DEVICE_MIG_DISABLE = 0
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(
        self,
        devices: Sequence[FakeGpu] = (),
        *,
        driver: bool = True,
        init_error: type[BaseException] | None = None,
        nvlink_pairs: Iterable[tuple[int, int]] | None = None,
    ) -> None:
        """`nvlink_pairs`: the device indices linked by NVLink; None: every device with
        NVLink links reaches every other one (an NVSwitch board)."""
        self.devices = list(devices)
        self.nvlink_pairs = None if nvlink_pairs is None else {frozenset(p) for p in nvlink_pairs}
        self.driver = driver
        self.init_error = init_error
        self.initialised = False
        self.shutdown_calls = 0

    @classmethod
    def of(cls, gpu: FakeGpu, count: int) -> FakeNVML:
        """`count` identical devices; each gets a distinct uuid."""
        return cls([_with_uuid(gpu, i) for i in range(count)])

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error("simulated NVML load failure")
        if not self.driver:
            raise NVMLError("NVML Shared Library Not Found")
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._require_init()
        self.initialised = False
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        self._require_init()
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._require_init()
        if not 0 <= index < len(self.devices):
            raise NVMLError("Invalid Argument")
        return self.devices[index]

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str:
        return handle.name

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        if handle.uuid is None:
            raise NVMLError("Not Supported")
        return handle.uuid

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> SimpleNamespace:
        return SimpleNamespace(total=handle.memory_bytes, free=handle.memory_bytes, used=0)

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeGpu) -> tuple[int, int]:
        return handle.cc

    def nvmlDeviceGetNvLinkState(self, handle: FakeGpu, link: int) -> int:
        if link >= handle.nvlink_links:
            raise NVMLError("Not Supported")
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> tuple[int, int]:
        """(current, pending) MIG mode; NVMLError where the GPU has none."""
        if handle.mig is None:
            raise NVMLError("Not Supported")
        return (self.NVML_DEVICE_MIG_ENABLE, self.NVML_DEVICE_MIG_ENABLE)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeGpu) -> int:
        if handle.mig is None:
            raise NVMLError("Not Supported")
        return len(handle.mig)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeGpu, index: int) -> FakeGpu:
        """The MIG device in slot `index`; NVMLError ("Not Found") for an empty slot."""
        self._require_init()
        slots = handle.mig or ()
        found = slots[index] if 0 <= index < len(slots) else None
        if found is None:
            raise NVMLError("Not Found")
        return found

    def nvmlDeviceGetP2PStatus(self, first: FakeGpu, second: FakeGpu, index: int) -> int:
        self._require_init()
        if index != self.NVML_P2P_CAPS_INDEX_NVLINK:
            raise NVMLError("Not Supported")
        i, j = self._index(first), self._index(second)
        if self.nvlink_pairs is None:
            linked = first.nvlink_links > 0 and second.nvlink_links > 0
        else:
            linked = frozenset({i, j}) in self.nvlink_pairs
        return self.NVML_P2P_STATUS_OK if linked else self.NVML_P2P_STATUS_NOT_SUPPORTED

    def _index(self, handle: FakeGpu) -> int:
        return next(n for n, d in enumerate(self.devices) if d is handle)

    def _require_init(self) -> None:
        if not self.initialised:
            raise NVMLError("Uninitialized")


def _with_uuid(gpu: FakeGpu, index: int) -> FakeGpu:
    return replace(gpu, uuid=f"GPU-fake-{index:04d}")
