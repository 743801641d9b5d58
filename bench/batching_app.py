"""The Celery app `bench/batching.py` runs: one inference request per message, on a
simulated GPU whose cost per call is `BASE_MS + PER_ITEM_MS * n` for n requests.

Environment:

    OJS_BENCH_BROKER      Redis URL (broker, result backend, timing list, plugin store)
    OJS_BENCH_PLUGIN      "1": `OJSML(app)` with `ml_batch` (max_size `OJS_BENCH_MAX_SIZE`,
                          max_wait_ms `OJS_BENCH_MAX_WAIT_MS`); "0": plain Celery, one
                          request per call, the model loaded in `worker_process_init`
    OJS_BENCH_PREFETCH    `ojs_ml_prefetch` for the plugin (default: the plugin's, 2)
    OJS_BENCH_CONF        more `ojs_ml_*` settings for the plugin, as JSON
    OJS_BENCH_BASE_MS     the fixed part of a call (default 20)
    OJS_BENCH_PER_ITEM_MS the part per request (default 0.5)

The cost model stands for a GPU forward pass that is bound by its fixed costs at
small batch sizes (kernel launches, weights read from memory, the host-device
round trip) and adds little per row until the device is busy: the same model
applies to both variants, the baseline calling it with n = 1. Each process
pays a simulated CUDA init (0.3 s, with a library named `libcuda.so.1` mapped so
the plugin sees CUDA) and a model load (1 s) once. Each call records one line per
request, `seq published end pid n`, in the Redis list `RESULTS_KEY`; each request's
result goes to the result backend under its own id.
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

RESULTS_KEY = "ojs-bench:batching"
CUDA_INIT_S = 0.3
MODEL_LOAD_S = 1.0
BASE_MS = float(os.environ.get("OJS_BENCH_BASE_MS", "20"))
PER_ITEM_MS = float(os.environ.get("OJS_BENCH_PER_ITEM_MS", "0.5"))
MAX_SIZE = int(os.environ.get("OJS_BENCH_MAX_SIZE", "32"))
MAX_WAIT_MS = float(os.environ.get("OJS_BENCH_MAX_WAIT_MS", "5"))
BROKER = os.environ.get("OJS_BENCH_BROKER", "redis://127.0.0.1:6399/0")
PLUGIN = os.environ.get("OJS_BENCH_PLUGIN") == "1"
_STATE: dict[str, Any] = {}

app = Celery("ojsbatch", broker=BROKER, backend=BROKER, set_as_current=False)
app.conf.update(
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    result_expires=600,
)
if PLUGIN:
    from celery_ojs_ml import OJSML

    app.conf.ojs_ml_recycle_gpu_children = "warm"
    app.conf.ojs_ml_heartbeat_s = 0.5
    if os.environ.get("OJS_BENCH_PREFETCH"):  # else the plugin's default
        app.conf.ojs_ml_prefetch = int(os.environ["OJS_BENCH_PREFETCH"])
    app.conf.update(json.loads(os.environ.get("OJS_BENCH_CONF") or "{}"))
    OJSML(app)


def cuda_init() -> None:
    """The process's first CUDA call: slow once, and the driver shows in /proc/self/maps."""
    if "cuda" in _STATE:
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


def load_model() -> dict[str, Any]:
    time.sleep(MODEL_LOAD_S)
    return {"pid": os.getpid()}


def forward(n: int) -> None:
    """One call on the simulated GPU for `n` requests."""
    time.sleep((BASE_MS + PER_ITEM_MS * n) / 1000.0)


def record(rows: list[tuple[int, float]]) -> None:
    """One line per request of the call: `seq published end pid n`."""
    end, pid = time.time(), os.getpid()
    client = _STATE.get("client") or _STATE.setdefault("client", redis.Redis.from_url(BROKER))
    client.rpush(RESULTS_KEY, *(f"{s} {p!r} {end!r} {pid} {len(rows)}" for s, p in rows))


@signals.worker_process_init.connect
def _preload(**_: Any) -> None:
    if not PLUGIN:  # the hand-made baseline: one worker per GPU, model loaded at start
        cuda_init()
        _STATE["model"] = load_model()


if PLUGIN:
    from celery_ojs_ml import model
    from celery_ojs_ml.child.batch import BatchRequest

    @app.task(bind=True, name="bench.infer", shared=False, ml={"ext_ml_gpu_count": 1},
              ml_batch={"max_size": MAX_SIZE, "max_wait_ms": MAX_WAIT_MS})  # fmt: skip
    def infer_batched(self: Any, requests: list[BatchRequest]) -> list[int]:
        """The plugin: one call for the batch the gate formed, on its one GPU."""
        cuda_init()
        model(self, ("bench-model", "1"), load_model)
        forward(len(requests))
        record([(int(r.args[0]), float(r.args[1])) for r in requests])
        return [int(r.args[0]) for r in requests]

else:

    @app.task(bind=True, name="bench.infer", shared=False)
    def infer_one(self: Any, seq: int, published: float) -> int:
        """The baseline: one call per request, on the GPU its worker was started on."""
        forward(1)
        record([(seq, published)])
        return seq
