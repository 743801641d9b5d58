"""The Celery app `bench/inference.py` runs: a GPU inference task with simulated CUDA.

Environment:

    OJS_BENCH_BROKER    Redis URL (broker, results list and the plugin's store)
    OJS_BENCH_PLUGIN    "1": `OJSML(app)`; "0": plain Celery (the hand-made baseline)
    OJS_BENCH_RECYCLE   `ojs_ml_recycle_gpu_children` for the plugin ("warm", "cuda")
    OJS_BENCH_PRELOAD   "1": load the model in `worker_process_init` (the baseline's way)
    OJS_BENCH_PREFETCH  `ojs_ml_prefetch` for the plugin (default 0)

Per process, the first GPU use costs a simulated CUDA init (`CUDA_INIT_S`, and a
library named `libcuda.so.1` is mapped so the plugin sees CUDA as it would for
real), and the first use of the model costs a load (`MODEL_LOAD_S`). Each
request then computes for `COMPUTE_S` and records `seq published start end pid
cold` in the Redis list `RESULTS_KEY`.
"""

from __future__ import annotations

import ctypes
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
COMPUTE_S = 0.02
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
    app.conf.ojs_ml_prefetch = int(os.environ.get("OJS_BENCH_PREFETCH", "0"))
    OJSML(app)


def cuda_init() -> None:
    """The process's first CUDA call: slow once, and the driver shows in /proc/self/maps."""
    if "cuda" in _STATE:
        return
    time.sleep(CUDA_INIT_S)
    import _bisect

    folder = tempfile.mkdtemp(prefix=f"ojs-bench-cuda-{os.getpid()}-")
    target = os.path.join(folder, "libcuda.so.1")
    shutil.copyfile(_bisect.__file__, target)
    ctypes.CDLL(target)
    os.unlink(target)
    os.rmdir(folder)
    _STATE["cuda"] = os.environ.get("CUDA_VISIBLE_DEVICES")


def load_model() -> dict[str, Any]:
    time.sleep(MODEL_LOAD_S)
    return {"weights": os.getpid()}


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
    time.sleep(COMPUTE_S)
    assert net["weights"] == os.getpid()
    end = time.time()
    client = _STATE.get("client") or _STATE.setdefault("client", redis.Redis.from_url(BROKER))
    client.rpush(RESULTS_KEY, f"{seq} {published!r} {start!r} {end!r} {os.getpid()} {int(cold)}")
