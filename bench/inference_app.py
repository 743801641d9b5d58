"""The Celery app `bench/inference.py` runs: a GPU inference task with simulated CUDA.

Environment:

    OJS_BENCH_BROKER    Redis URL (broker, results list and the plugin's store)
    OJS_BENCH_PLUGIN    "1": `OJSML(app)`; "0": plain Celery (the hand-made baseline)
    OJS_BENCH_RECYCLE   `ojs_ml_recycle_gpu_children` for the plugin ("warm", "cuda")
    OJS_BENCH_PRELOAD   "1": load the model in `worker_process_init` (the baseline's way)
    OJS_BENCH_PREFETCH  `ojs_ml_prefetch` for the plugin (default: the plugin's, 2)
    OJS_BENCH_PIPELINE  "0": `ojs_ml_pipeline = False` for the plugin (default: on)
    OJS_BENCH_FAIR_SHARE `ojs_ml_fair_share` for the plugin, as JSON (default: none)
    OJS_BENCH_REAL      "1": real CUDA through PyTorch on real GPUs (`--real`)
    OJS_BENCH_BODY      "h200": the calibrated request body (`--calibrated`, below)
    OJS_BENCH_RESULT_BYTES  the size of the request's result, in bytes of floats (0: None)
    OJS_BENCH_TRACE     "1": record when the worker received each request (`--trace`)

Simulated (the default, for machines without a GPU): per process, the first
GPU use costs a simulated CUDA init (`CUDA_INIT_S`, and a library named
`libcuda.so.1` is mapped so the plugin sees CUDA as it would for real), and the
first use of the model costs a load (`MODEL_LOAD_S`); a request computes for
`COMPUTE_S`.

Calibrated (`OJS_BENCH_BODY=h200`, `bench/inference.py --calibrated`): the request
body of the H200 runs (`bench/results/h200-*`), each request `H200_CPU_S` of CPU (the
kernel launches) then a blocking sleep (the CUDA synchronisation: the child waits, the
main process cannot use that time for the child) drawn from a gamma distribution of
mean `H200_SYNC_S` and shape `H200_SHAPE`, seeded by the request's number so every
variant gets the same times. It returns `OJS_BENCH_RESULT_BYTES` of floats.

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
import random
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
BODY = os.environ.get("OJS_BENCH_BODY", "")
RESULT_BYTES = int(os.environ.get("OJS_BENCH_RESULT_BYTES", "0"))
H200_CPU_S = 0.0003
H200_SYNC_S = 0.0036
H200_SHAPE = 16.0
"""The H200 request body: 3.9 ms mean, p90 about +1.2 ms (docs/performance.md,
"`bench/inference.py --calibrated`")."""
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
    app.conf.ojs_ml_pipeline = os.environ.get("OJS_BENCH_PIPELINE", "1") != "0"
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


def compute(net: dict[str, Any], seq: int = 0) -> None:
    if BODY == "h200":
        h200_body(seq)
        return
    if not REAL:
        time.sleep(COMPUTE_S)
        return
    import torch

    with torch.inference_mode():
        x = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
        for _ in range(REAL_ITERS):
            x = net["net"](x)
        torch.cuda.synchronize()


def h200_body(seq: int) -> None:
    """The calibrated body: CPU for the launches, then a synchronisation drawn per request."""
    spin_until = time.perf_counter() + H200_CPU_S
    while time.perf_counter() < spin_until:
        pass
    time.sleep(random.Random(seq).gammavariate(H200_SHAPE, H200_SYNC_S / H200_SHAPE))


def result_of(seq: int) -> list[float] | None:
    """The request's output: `RESULT_BYTES` of floats (8 bytes each), or None."""
    if not RESULT_BYTES:
        return None
    return [seq + i / 7 for i in range(RESULT_BYTES // 8)]


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
def infer(self: Any, seq: int, published: float) -> list[float] | None:
    start = time.time()
    cold = "cuda" not in _STATE
    cuda_init()
    if PLUGIN:
        from celery_ojs_ml import model

        net = model(self, ("bench-model", "1"), load_model)
    else:
        net = _STATE.get("model") or _STATE.setdefault("model", load_model())
    compute(net, seq)
    assert net["weights"] == os.getpid()
    end = time.time()
    client = _STATE.get("client") or _STATE.setdefault("client", redis.Redis.from_url(BROKER))
    line = f"{seq} {published!r} {start!r} {end!r} {os.getpid()} {int(cold)}{real_facts()}"
    client.rpush(RESULTS_KEY, line)
    return result_of(seq)


TRACE_KEY = "ojs-bench:received"


@signals.task_received.connect  # type: ignore[untyped-decorator]
def _trace_received(request: Any = None, **_: Any) -> None:
    """`OJS_BENCH_TRACE=1`: record when the worker's main process received each request
    and how it came (`seq time kind` in `TRACE_KEY`; kind: `g` under a grant, `a` assigned
    by the scheduler, `ap` assigned ahead of capacity, `-` plain), to split the gap
    between two requests."""
    if os.environ.get("OJS_BENCH_TRACE") != "1" or request is None:
        return
    client = _STATE.get("client") or _STATE.setdefault("client", redis.Redis.from_url(BROKER))
    from celery_ojs_ml.wire import headers as h

    found = request.request_dict
    kind = "".join(k[4] for k in (h.GRANT, h.ASSIGN, h.PREFETCH) if found.get(k))
    client.rpush(TRACE_KEY, f"{request.args[0]} {time.time()!r} {kind or '-'}")
