"""Pool-child side: pin `CUDA_VISIBLE_DEVICES` (and TPU chips: `child.tpu_env`) around each
ML task body.

Key decisions (research/celery-internals.md §3):
* The main process allocates and puts the device list in the request (`ojs_devices`);
  `task_prerun` sets the variable before the task body runs, `task_postrun` restores
  it. Only when the gate says so (`ojs_pin`, i.e. prefork): under other pools the
  environment is the whole process's, and the task reads `self.request.ojs_devices`.
* CUDA reads the variable once per process, so a child is retired as soon as a task
  has initialised CUDA in it (`install_cuda_retirement`); children that never touched
  CUDA are reused as in plain Celery. `ojs_ml_recycle_gpu_children` picks the policy
  (`worker/setup.py`).
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

from celery_ojs_ml.child.gang_env import restore_env, set_env
from celery_ojs_ml.child.limits import set_limits
from celery_ojs_ml.child.run_env import restore_run_env, set_run_env
from celery_ojs_ml.child.sharing import restore_share_env, set_share_env
from celery_ojs_ml.child.tpu_env import restore_tpu_env, set_tpu_env
from celery_ojs_ml.child.warm_slot import take_move
from celery_ojs_ml.wire import headers as h

log = logging.getLogger(__name__)
CVD = "CUDA_VISIBLE_DEVICES"
ORDER = "CUDA_DEVICE_ORDER"
RECYCLE_MODES = ("warm", "cuda", "always", "never")
RECYCLE: dict[str, Any] = {"mode": "never"}
"""Set in the worker's main process at `celeryd_init`; pool children inherit it by fork."""
NO_LIMIT_KB = 1 << 40
"""`worker_max_memory_per_child` put in place when unset: 1 PiB, which no child reaches."""
RETIRE_KB = 1 << 62
"""What the child reports as its memory use once it must be retired."""
_MAXMEM_PREFIX = "child process exiting after exceeding memory limit"
_DRIVER = b"/libcuda.so"
_EXIT_POLL_S = 0.005


def cuda_initialised(maps: str = "/proc/self/maps") -> bool:
    """Whether the CUDA driver library is mapped into this process.

    CUDA reads `CUDA_VISIBLE_DEVICES` when the driver initialises, and every
    framework (PyTorch, JAX, CuPy, TensorFlow, numba) loads `libcuda.so` to do
    that. Where `/proc` cannot be read the answer is True: assume the worst.
    """
    try:
        with open(maps, "rb") as fh:
            return _DRIVER in fh.read()
    except OSError:
        return True


class _PhdrInfo(ctypes.Structure):
    """The head of glibc's `struct dl_phdr_info` (link.h), up to `dlpi_subs`."""

    _fields_ = [
        ("dlpi_addr", ctypes.c_void_p),
        ("dlpi_name", ctypes.c_char_p),
        ("dlpi_phdr", ctypes.c_void_p),
        ("dlpi_phnum", ctypes.c_uint16),
        ("dlpi_adds", ctypes.c_ulonglong),
        ("dlpi_subs", ctypes.c_ulonglong),
    ]


_PHDR_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(_PhdrInfo), ctypes.c_size_t, ctypes.c_void_p
)
_LOADS: dict[str, Any] = {}


def loaded_objects() -> int | None:
    """How many shared objects this process has loaded so far; None where unknown.

    glibc (and musl) keep the count in `dlpi_adds`, which `dl_iterate_phdr`
    hands to its callback; the callback stops after the first object.
    """
    if "iterate" not in _LOADS:
        _LOADS["iterate"] = None
        try:
            iterate = ctypes.CDLL(None).dl_iterate_phdr
            iterate.argtypes = [_PHDR_CALLBACK, ctypes.c_void_p]
            iterate.restype = ctypes.c_int
        except (OSError, AttributeError):
            return None

        def first(info: Any, size: int, _data: Any) -> int:
            full = size >= ctypes.sizeof(_PhdrInfo)
            _LOADS["count"] = int(info.contents.dlpi_adds) if full else None
            return 1

        _LOADS["callback"] = _PHDR_CALLBACK(first)
        _LOADS["iterate"] = iterate
    iterate = _LOADS["iterate"]
    if iterate is None:
        return None
    _LOADS["count"] = None
    iterate(_LOADS["callback"], None)
    count: int | None = _LOADS["count"]
    return count


class DriverWatch:
    """`cuda_initialised()`, read again only when a shared object was loaded since.

    Reading `/proc/self/maps` costs about half a millisecond, so the watch first asks
    glibc how many shared objects this process has ever loaded (`loaded_objects`,
    about a microsecond) and reads the maps only when that changed: CUDA cannot
    initialise without loading its driver.
    """

    def __init__(self) -> None:
        self.clean_at: int | None = None
        """The load count at the last check that found no driver."""

    def __call__(self) -> bool:
        count = loaded_objects()
        if count is not None and count == self.clean_at:
            return False
        if cuda_initialised():
            return True
        self.clean_at = count
        return False


def billiard_can_retire() -> bool:
    """Whether this billiard has the per-task memory check the retire hook rides on."""
    import inspect

    import billiard.pool as bpool

    params = inspect.signature(bpool.Worker.__init__).parameters
    return (
        callable(getattr(bpool, "mem_rss", None))
        and "max_memory_per_child" in params
        and hasattr(bpool, "GUARANTEE_MESSAGE_CONSUMPTION_RETRY_INTERVAL")
        and hasattr(bpool, "GUARANTEE_MESSAGE_CONSUMPTION_RETRY_LIMIT")
    )


def install_cuda_retirement() -> None:
    """In a pool child: exit after any task that left CUDA initialised.

    billiard's worker loop calls `mem_rss()` after it has sent each task's
    result and leaves with `EX_RECYCLE` when the value is over
    `max_memory_per_child`; the pool then starts a fresh child. The hook reports
    a huge value once CUDA is initialised, and the real value otherwise, so a
    user's own `worker_max_memory_per_child` keeps working.
    """
    import billiard.pool as bpool

    real_rss, real_warning = bpool.mem_rss, bpool.warning
    state = {"retiring": False}
    watch = DriverWatch()
    inherited = watch()
    if inherited:
        log.warning(
            "ojs-ml: CUDA was initialised in the worker's main process before the pool "
            "forked (CUDA does not survive fork); every pool child will run one task"
        )

    def mem_rss() -> int:
        if inherited or watch():
            state["retiring"] = True
            log.debug("ojs-ml: pool child %s initialised CUDA; retiring it", os.getpid())
            return RETIRE_KB
        return int(real_rss())

    def warning(msg: Any, *args: Any, **kwargs: Any) -> Any:
        if state["retiring"] and str(msg).startswith(_MAXMEM_PREFIX):
            return None  # our retirement, not a memory problem
        return real_warning(msg, *args, **kwargs)

    bpool.mem_rss = mem_rss
    bpool.warning = warning
    _poll_exit_often(bpool)


def _poll_exit_often(bpool: Any) -> None:
    """Before leaving, a child polls until the parent has read its last result, by
    default every 0.1 s: most retirements would sleep once. Poll every 5 ms for the
    same 30 s in all."""
    interval = bpool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_INTERVAL
    total = interval * bpool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_LIMIT
    bpool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_INTERVAL = _EXIT_POLL_S
    bpool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_LIMIT = max(1, int(total / _EXIT_POLL_S))


def pin_request(request: Any) -> None:
    """`task_prerun`, for the task's request (read once: `task.request` is a stack lookup):
    set CUDA_VISIBLE_DEVICES to exactly the allocated devices."""
    if request is None:
        return
    set_run_env(request)  # a Flux job's cwd and environment, first (child.run_env)
    set_limits(request)  # the job's CPUs and memory bound (child.limits)
    set_env(request)  # a gang rank's MASTER_ADDR, RANK, ... (child.gang_env)
    set_share_env(request)  # a GPU share's MPS memory limit (child.sharing)
    set_tpu_env(request)  # the TPU chips: TPU_VISIBLE_CHIPS, ... (child.tpu_env)
    take_move(request)  # warm children: the job was moved onto this child's devices
    devices = getattr(request, h.DEVICES, None)
    if devices is None or not getattr(request, h.PIN, False):
        return
    environ = os.environ
    request.ojs_saved_cvd = environ.get(CVD)
    environ[CVD] = pinned(devices)
    if environ.get(ORDER) != "PCI_BUS_ID":  # CUDA numbers devices as NVML does
        environ[ORDER] = "PCI_BUS_ID"


VISIBLE: dict[str, list[str] | None] = {"tokens": None}
"""The devices the worker itself was given (`probe.visible_tokens`), read at `celeryd_init`
before the pool forks; allocation index i is the i-th of them."""


def pinned(devices: Any) -> str:
    """CUDA_VISIBLE_DEVICES for allocated indices: the worker's own visible devices when it
    was started with some (two workers on one host with `0,1` and `2,3` never collide)."""
    tokens = VISIBLE["tokens"]
    if tokens is None:
        return ",".join(str(d) for d in devices)
    return ",".join(tokens[int(d)] for d in devices if 0 <= int(d) < len(tokens))


def unpin_request(request: Any) -> None:
    """`task_postrun`, for the task's request: restore the variable as it was before."""
    if request is None:
        return
    restore_env(request)
    restore_share_env(request)
    restore_tpu_env(request)
    if hasattr(request, "ojs_saved_cvd"):
        saved = request.ojs_saved_cvd
        if saved is None:
            os.environ.pop(CVD, None)
        else:
            os.environ[CVD] = saved
    restore_run_env(request)  # last: the job's own cwd and variables (child.run_env)


def devices(task: Any) -> list[int]:
    """The GPU indices allocated to the running task (any pool); [] for none."""
    found = getattr(getattr(task, "request", None), h.DEVICES, None)
    return [int(d) for d in found] if found else []
