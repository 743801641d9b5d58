"""The Celery app `bench/inference.py` runs: a GPU inference task with simulated CUDA.

Environment:

    OJS_BENCH_BROKER    Redis URL (broker, results list and the plugin's store)
    OJS_BENCH_PLUGIN    "1": `OJSML(app)`; "0": plain Celery (the hand-made baseline)
    OJS_BENCH_RECYCLE   `ojs_ml_recycle_gpu_children` for the plugin ("warm", "cuda")
    OJS_BENCH_PRELOAD   "1": load the model in `worker_process_init` (the baseline's way)
    OJS_BENCH_PREFETCH  `ojs_ml_prefetch` for the plugin (default: the plugin's, 2)
    OJS_BENCH_FAIR_SHARE `ojs_ml_fair_share` for the plugin, as JSON (default: none)
    OJS_BENCH_REAL      "1": real CUDA through PyTorch on real GPUs (`--real`)

Simulated (the default, for machines without a GPU): per process, the first
GPU use costs a simulated CUDA init (`CUDA_INIT_S`, and a library named
`libcuda.so.1` is mapped so the plugin sees CUDA as it would for real), and the
first use of the model costs a load (`MODEL_LOAD_S`); a request computes for
`COMPUTE_S`.

Real (`OJS_BENCH_REAL=1`): the first GPU use creates the CUDA context, the model
is an 8-layer 4096-wide fp16 MLP (268 MB) built and moved to the GPU, and a
request is `REAL_ITERS` forward passes of a 64-row batch, synchronised. Each
request also records the devices CUDA was initialised with in its process, the
devices pinned for this task, and the UUID that torch sees, so `bench/real_gpu.py`
can check the warm-child invariant on real hardware.

Each request records `seq published start end pid cold [real facts]` in the
Redis list `RESULTS_KEY`.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import tempfile
import time
from typing import Any

import redis
from celery import Celery, signals

RESULTS_KEY = "ojs-bench:inference"
CUDA_INIT_S = 0.3
MODEL_LOAD_S = 1.0
COMPUTE_S = float(os.environ.get("OJS_BENCH_COMPUTE_S", "0.02"))
REAL_ITERS = int(os.environ.get("OJS_BENCH_REAL_ITERS", "20"))
REAL = os.environ.get("OJS_BENCH_REAL") == "1"
_STATE: dict[str, Any] = {}

BROKER = os.environ.get("OJS_BENCH_BROKER", "redis://127.0.0.1:6399/0")
PLUGIN = os.environ.get("OJS_BENCH_PLUGIN") == "1"
app = Celery("ojsinfer", broker=BROKER, set_as_current=False)
app.conf.update(
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
)
if PLUGIN:
    from celery_ojs_ml import OJSML

    app.conf.ojs_ml_recycle_gpu_children = os.environ.get("OJS_BENCH_RECYCLE", "warm")
    app.conf.ojs_ml_heartbeat_s = 0.5
    if os.environ.get("OJS_BENCH_PREFETCH"):  # else the plugin's default
        app.conf.ojs_ml_prefetch = int(os.environ["OJS_BENCH_PREFETCH"])
    if os.environ.get("OJS_BENCH_FAIR_SHARE"):
        app.conf.ojs_ml_fair_share = json.loads(os.environ["OJS_BENCH_FAIR_SHARE"])
    OJSML(app)


def cuda_init() -> None:
    """The process's first CUDA call: slow once, and the driver shows in /proc/self/maps."""
    if "cuda" in _STATE:
        return
    if REAL:
        _real_cuda_init()
        return
    time.sleep(CUDA_INIT_S)
    from celery_ojs_ml.testing import fake_cuda

    folder = tempfile.mkdtemp(prefix=f"ojs-bench-cuda-{os.getpid()}-")
    target = os.path.join(folder, "libcuda.so.1")
    shutil.copyfile(fake_cuda.shared_object(), target)
    ctypes.CDLL(target)
    os.unlink(target)
    os.rmdir(folder)
    _STATE["cuda"] = os.environ.get("CUDA_VISIBLE_DEVICES")


def _real_cuda_init() -> None:
    import torch

    _STATE["cuda"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    _STATE["uuid"] = str(torch.cuda.get_device_properties(0).uuid)
    _STATE["count"] = torch.cuda.device_count()


def load_model() -> dict[str, Any]:
    if REAL:
        import torch

        layers = [torch.nn.Linear(4096, 4096) for _ in range(8)]
        net = torch.nn.Sequential(*layers).half().cuda().eval()
        torch.cuda.synchronize()
        return {"weights": os.getpid(), "net": net}
    time.sleep(MODEL_LOAD_S)
    return {"weights": os.getpid()}


def compute(net: dict[str, Any]) -> None:
    if not REAL:
        time.sleep(COMPUTE_S)
        return
    import torch

    with torch.inference_mode():
        x = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
        for _ in range(REAL_ITERS):
            x = net["net"](x)
        torch.cuda.synchronize()


def real_facts() -> str:
    """`init_cvd task_cvd torch_uuid device_count` ("-" for unset), real mode only."""
    if not REAL:
        return ""
    task_cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    facts = (_STATE.get("cuda"), task_cvd, _STATE.get("uuid"), _STATE.get("count"))
    return " " + " ".join("-" if f is None or f == "" else str(f) for f in facts)


@signals.worker_process_init.connect
def _preload(**_: Any) -> None:
    if os.environ.get("OJS_BENCH_PRELOAD") == "1":
        cuda_init()
        _STATE["model"] = load_model()


@app.task(bind=True, name="bench.infer", shared=False, ml={"ext_ml_gpu_count": 1})  # type: ignore[untyped-decorator]
def infer(self: Any, seq: int, published: float) -> None:
    start = time.time()
    cold = "cuda" not in _STATE
    cuda_init()
    if PLUGIN:
        from celery_ojs_ml import model

        net = model(self, ("bench-model", "1"), load_model)
    else:
        net = _STATE.get("model") or _STATE.setdefault("model", load_model())
    compute(net)
    assert net["weights"] == os.getpid()
    end = time.time()
    client = _STATE.get("client") or _STATE.setdefault("client", redis.Redis.from_url(BROKER))
    line = f"{seq} {published!r} {start!r} {end!r} {os.getpid()} {int(cold)}{real_facts()}"
    client.rpush(RESULTS_KEY, line)
