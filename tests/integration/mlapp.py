"""The Celery app the integration tests run in real `celery worker` processes.

`celery -A tests.integration.mlapp worker ...` reads the broker from
`OJS_TEST_BROKER`; tests build the same app in-process with `make_app(url)` to
publish. Tasks record what they saw (worker, devices, CUDA_VISIBLE_DEVICES,
pid, times) in the Redis list `OJS_TEST_RESULTS` so the tests can check the
invariants from outside.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from celery_ojs_ml import OJSML
from celery_ojs_ml.testing import fake_cuda

RESULTS_KEY = "ojs-test:results"
HOLD_KEY = "ojs-test:release:"
_CUDA_LOCK = threading.RLock()
_FIRST_GPU_USE: dict[str, Any] = {}
"""Per process: the CUDA_VISIBLE_DEVICES seen at the process's first GPU use."""


def init_fake_cuda() -> None:
    """Stand-in for a framework's first CUDA call: map a library named `libcuda.so.1`.

    There is no GPU here, so the test loads a copy of a small shared object
    under the driver's name; the plugin's detection (`child.cuda_initialised`)
    reads `/proc/self/maps` exactly as it would for the real driver.
    """
    import ctypes
    import shutil
    import tempfile

    with _CUDA_LOCK:  # the threads pool runs tasks of one process concurrently
        folder = os.path.join(tempfile.gettempdir(), f"ojs-fake-cuda-{os.getpid()}")
        os.makedirs(folder, exist_ok=True)
        target = os.path.join(folder, "libcuda.so.1")
        shutil.copyfile(fake_cuda.shared_object(), target)
        ctypes.CDLL(target)
        # The mapping stays (as "... libcuda.so.1 (deleted)"), so detection still sees it.
        os.unlink(target)
        os.rmdir(folder)


def make_app(broker: str, **conf: Any) -> Celery:
    """The test app on `broker` (a private Redis, or RabbitMQ for the broker test)."""
    results_url = os.environ.get("OJS_TEST_RESULTS", broker)
    backend = results_url if results_url.startswith("redis") else None
    app = Celery("mlapp", broker=broker, backend=backend, set_as_current=False)
    app.conf.update(
        task_create_missing_queues=True,
        worker_prefetch_multiplier=1,
        # the test workers fetch any model version (§4); a test that checks pinning to
        # loaded versions turns it off through OJS_TEST_CONF
        ojs_ml_model_registry_access=True,
        broker_transport_options={
            "visibility_timeout": float(os.environ.get("OJS_TEST_VISIBILITY", "3600")),
            # kombu sweeps unacked messages every interval x throttle s (100 s by default);
            # a message whose worker died before its lease was written waits for that sweep.
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            # A worker SIGKILLed while it holds kombu's restore mutex blocks every sweep
            # until the mutex expires (300 s by default); the kill test shortens it.
            "unacked_mutex_expire": float(os.environ.get("OJS_TEST_MUTEX_EXPIRE", "300")),
        },
        result_expires=None,
        worker_hijack_root_logger=False,
        task_default_queue=os.environ.get("OJS_TEST_QUEUE", "celery"),
        ojs_ml_store_url=os.environ.get("OJS_TEST_STORE"),
        ojs_ml_subscription_poll_s=0.2,
        ojs_ml_heartbeat_s=0.5,
        ojs_ml_lease_ttl_s=float(os.environ.get("OJS_TEST_LEASE_TTL", "30")),
        ojs_ml_max_crashes=int(os.environ.get("OJS_TEST_MAX_CRASHES", "3")),
        ojs_ml_require_pinning=os.environ.get("OJS_TEST_REQUIRE_PINNING") == "1",
        ojs_ml_recycle_gpu_children=os.environ.get("OJS_TEST_RECYCLE", "cuda"),
        ojs_ml_min_runtime_before_preemption_s=float(os.environ.get("OJS_TEST_MIN_RUNTIME", "60")),
        ojs_ml_assignment_timeout_s=float(os.environ.get("OJS_TEST_ASSIGN_TIMEOUT", "15")),
        ojs_ml_leader_ttl_s=float(os.environ.get("OJS_TEST_LEADER_TTL", "5")),
        # file:// checkpoint storage must be granted (OJS ML Extensions §12.1): the training
        # tasks' directory, and the temp dir the tests' own directories live in
        ojs_ml_checkpoint_prefixes=[f"file://{_ckpt_dir()}/", f"file://{tempfile.gettempdir()}/"],
    )
    if os.environ.get("OJS_TEST_GRANTS") == "0":  # the whole suite with a decision per job
        app.conf.ojs_ml_grants = False
    app.conf.update(json.loads(os.environ.get("OJS_TEST_CONF", "{}")))  # per-test settings
    app.conf.update(conf)
    OJSML(app)
    _define_tasks(app, results_url)
    _define_plain_tasks(app, results_url)
    _define_gang_tasks(app, results_url)
    _define_hold_task(app, results_url)
    return app


def _ckpt_dir() -> str:
    return os.environ.get("OJS_TEST_CKPT", "/tmp/ojs-test-ckpt")


def _record(results_url: str, entry: dict[str, Any]) -> None:
    client = redis.Redis.from_url(results_url)
    try:
        client.rpush(RESULTS_KEY, json.dumps(entry))
    finally:
        client.close()


def _define_tasks(app: Celery, results_url: str) -> None:
    @app.task(bind=True, name="ml.record", shared=False, ml={"ext_ml_gpu_count": 1})
    def record(self: Any, tag: str, sleep_s: float = 0.0, cuda: bool = True) -> dict[str, Any]:
        start = time.time()
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = list(getattr(self.request, "ojs_devices", None) or [])
        if devices and cuda:
            with _CUDA_LOCK:
                if "cvd" not in _FIRST_GPU_USE:
                    init_fake_cuda()  # the process's first GPU use: CUDA binds devices here
                    _FIRST_GPU_USE["cvd"] = cvd
        first = not (getattr(self.request, "ojs_crashes", 0) or 0)  # a re-run is not slowed
        scale = float(os.environ.get("OJS_TEST_SLEEP_SCALE") or 1.0) if first else 1.0
        time.sleep(sleep_s * scale)
        entry = {
            "tag": tag,
            "task_id": self.request.id,
            "worker": getattr(self.request, "ojs_node", None),
            "hostname": socket.gethostname(),
            "devices": devices,
            "cvd": cvd,
            "cuda": bool(devices and cuda),
            "first_cvd": _FIRST_GPU_USE.get("cvd"),
            "pid": os.getpid(),
            "gpu_count": getattr(self.request, "ext_ml_gpu_count", None),
            "crashes": getattr(self.request, "ojs_crashes", 0) or 0,
            "grant": getattr(self.request, "ojs_grant", None),
            "assigned": bool(getattr(self.request, "ojs_assign", None)),
            "share": getattr(self.request, "ojs_gpu_share", None),
            "master_addr": os.environ.get("MASTER_ADDR"),
            "preemptions": getattr(self.request, "ojs_preemptions", 0) or 0,
            "last_checkpoint": getattr(self.request, "ojs_last_checkpoint", None),
            "start": start,
            "end": time.time(),
        }
        _record(results_url, entry)
        return entry

    _define_training_tasks(app, results_url)
    _define_share_tasks(app, results_url)


def _define_share_tasks(app: Celery, results_url: str) -> None:
    share_ml = {"ojs_ml_gpu_share": True, "ext_ml_gpu_memory_gb": 30}

    @app.task(bind=True, name="ml.share", shared=False, ml=share_ml)
    def share(self: Any, tag: str, sleep_s: float = 0.0) -> dict[str, Any]:
        start = time.time()
        first = not (getattr(self.request, "ojs_crashes", 0) or 0)  # a re-run is not slowed
        scale = float(os.environ.get("OJS_TEST_SLEEP_SCALE") or 1.0) if first else 1.0
        time.sleep(sleep_s * scale)
        entry = {
            "tag": tag,
            "task_id": self.request.id,
            "worker": getattr(self.request, "ojs_node", None),
            "devices": list(getattr(self.request, "ojs_devices", None) or []),
            "share": getattr(self.request, "ojs_gpu_share", None),
            "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "mps_limit": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
            "start": start,
            "end": time.time(),
        }
        _record(results_url, entry)
        return entry


def _define_training_tasks(app: Celery, results_url: str) -> None:
    ckpt_dir = _ckpt_dir()
    ckpt_ml = {
        "ext_ml_gpu_count": 1,
        "ext_ml_checkpoint_enabled": True,
        "ext_ml_checkpoint_storage_uri": f"file://{ckpt_dir}/",
        "ext_ml_checkpoint_max_count": 3,
        "ext_ml_checkpoint_interval_s": 1,
    }

    @app.task(bind=True, name="ml.ckpt_train", shared=False, ml=ckpt_ml)
    def ckpt_train(
        self: Any, epochs: int, epoch_s: float, ignore_preemption: bool = False, final: bool = False
    ) -> int:
        """Checkpoint every epoch; record where each run started and what was committed.
        `final`: the last save is final (`save(final=True)`, docs/checkpoint.md)."""
        from celery_ojs_ml import checkpoint
        from celery_ojs_ml.checkpoint import last_checkpoint

        client = redis.Redis.from_url(results_url)
        ckpt = checkpoint(self)
        committed = last_checkpoint(ckpt.store, self.request.id)
        last = ckpt.resume()
        start = (last.epoch + 1) if last and last.epoch is not None else 0
        run = {
            "pid": os.getpid(),
            "worker": getattr(self.request, "ojs_node", None),
            "start_epoch": start,
            "committed_epoch": committed.epoch if committed else None,
            "crashes": getattr(self.request, "ojs_crashes", 0) or 0,
            "retries": self.request.retries,
            "preemptions": getattr(self.request, "ojs_preemptions", 0) or 0,
            "t0": time.time(),
        }
        key = f"ojs-test:runs:{self.request.id}"
        index = client.rpush(key, json.dumps(run)) - 1
        for epoch in range(start, epochs):
            time.sleep(epoch_s)
            ckpt.save(
                epoch=epoch,
                step=epoch,
                loss=1.0 / (epoch + 1),
                files={"state.json": json.dumps({"epoch": epoch}).encode()},
                final=final and epoch == epochs - 1,
                result=epochs,
            )
            client.lset(key, index, json.dumps({**run, "t1": time.time(), "epoch": epoch}))
            if not ignore_preemption:
                ckpt.yield_if_preempted()
        client.lset(key, index, json.dumps({**run, "t1": time.time(), "done": True}))
        client.incr(f"ojs-test:done:{self.request.id}")
        client.close()
        return epochs

    @app.task(bind=True, name="ml.torch_train", shared=False, ml=ckpt_ml)
    def torch_train(self: Any, epochs: int, pause_s: float) -> str:
        """Real PyTorch CPU training with a checkpoint per epoch; returns the final weights."""
        from celery_ojs_ml import checkpoint
        from tests.integration import torchjob

        client = redis.Redis.from_url(results_url)
        ckpt = checkpoint(self)
        model, optim = torchjob.setup()
        last = ckpt.resume()
        start = 0
        if last is not None and last.epoch is not None:
            torchjob.load_state(model, optim, ckpt.load_bytes("state.pt"))
            start = last.epoch + 1
        client.rpush(
            f"ojs-test:torch-runs:{self.request.id}",
            json.dumps({"start": start, "worker": getattr(self.request, "ojs_node", None)}),
        )
        for epoch in range(start, epochs):
            loss = torchjob.train_epoch(model, optim, epoch)
            ckpt.save(
                epoch=epoch,
                step=epoch,
                loss=loss,
                files={"state.pt": torchjob.state_bytes(model, optim)},
            )
            client.set(f"ojs-test:torch-epoch:{self.request.id}", epoch)
            time.sleep(pause_s)
        weights = torchjob.weights_bytes(model).hex()
        client.set(f"ojs-test:torch-weights:{self.request.id}", weights)
        client.close()
        return "ok"

    @app.task(bind=True, name="ml.flaky_train", shared=False, ml=ckpt_ml, max_retries=0)
    def flaky_train(self: Any, epochs: int, fail_at: int) -> int:
        """Fails for good at `fail_at` on its first run; a resumed run completes."""
        from celery_ojs_ml import checkpoint

        ckpt = checkpoint(self)
        last = ckpt.resume()
        start = (last.epoch + 1) if last and last.epoch is not None else 0
        client = redis.Redis.from_url(results_url)
        client.rpush(f"ojs-test:flaky:{self.request.id}", start)
        client.close()
        for epoch in range(start, epochs):
            if last is None and epoch == fail_at:
                raise RuntimeError(f"boom at epoch {epoch}")
            ckpt.save(epoch=epoch, step=epoch, files={"s": b"x"})
        return epochs


def _define_gang_tasks(app: Celery, results_url: str) -> None:
    @app.task(bind=True, name="ml.gang_stuck", shared=False, ml={"ext_ml_cpu_cores": 1})
    def gang_stuck(self: Any, hold_s: float) -> dict[str, Any]:
        """A gang rank whose first placement fails: rank 0 raises at once, as when its
        store cannot listen; the others block for `hold_s`, as a rendezvous waits for a peer
        that is gone. Placed again, every rank returns at once."""
        crashes = int(getattr(self.request, "ojs_crashes", 0) or 0)
        rank = int(os.environ["RANK"])
        run = {"rank": rank, "crashes": crashes, "worker": getattr(self.request, "ojs_node", None)}
        _record(results_url, {"tag": "gang-stuck", "t": time.time(), **run})
        if crashes == 0:
            if rank == 0:
                raise RuntimeError("rank 0 could not open its rendezvous")
            time.sleep(hold_s)
        return run

    @app.task(bind=True, name="ml.allreduce", shared=False, ml={"ext_ml_cpu_cores": 1})
    def allreduce(self: Any, pause_s: float = 0.0) -> dict[str, Any]:
        """One rank of a 2-rank gloo all-reduce: each adds RANK + 1."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        start = time.time()
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
        try:
            value = torch.tensor([float(int(os.environ["RANK"]) + 1)])
            dist.all_reduce(value)
            time.sleep(pause_s)
        finally:
            dist.destroy_process_group()
        entry = {
            "tag": "allreduce",
            "task_id": self.request.id,
            "worker": getattr(self.request, "ojs_node", None),
            "sum": float(value.item()),
            "env": {
                k: os.environ.get(k)
                for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
            },
            "start": start,
            "end": time.time(),
        }
        _record(results_url, entry)
        return entry

    ckpt_dir = _ckpt_dir()
    gang_ml = {
        "ext_ml_cpu_cores": 1,
        "ext_ml_checkpoint_enabled": True,
        "ext_ml_checkpoint_storage_uri": f"file://{ckpt_dir}/",
        "ext_ml_checkpoint_interval_s": 1,
    }

    @app.task(bind=True, name="ml.gang_train", shared=False, ml=gang_ml)
    def gang_train(self: Any, epochs: int, epoch_s: float) -> dict[str, Any]:
        """Data-parallel training in miniature: one all-reduce and one checkpoint per epoch.

        The ranks resume from the earliest epoch any of them committed (agreed by an
        all-reduce MIN), as a real job resumes from rank 0's checkpoint."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from celery_ojs_ml import checkpoint

        ckpt = checkpoint(self)
        last = ckpt.resume()
        mine = (last.epoch + 1) if last and last.epoch is not None else 0
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=30))
        try:
            agreed = torch.tensor([float(mine)])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            start = int(agreed.item())
            run = {
                "task_id": self.request.id,
                "rank": rank,
                "worker": getattr(self.request, "ojs_node", None),
                "start_epoch": start,
                "port": os.environ.get("MASTER_PORT"),
                "crashes": getattr(self.request, "ojs_crashes", 0) or 0,
                "t0": time.time(),
            }
            _record(results_url, {"tag": "gang-run", **run})
            total = 0.0
            for epoch in range(start, epochs):
                value = torch.tensor([float(rank + 1)])
                dist.all_reduce(value)
                total = float(value.item())
                time.sleep(epoch_s)
                ckpt.save(epoch=epoch, step=epoch, files={"state.json": b"{}"})
        finally:
            dist.destroy_process_group()
        return {**run, "sum": total}

    infer_ml = {"ext_ml_gpu_count": 1, "ext_ml_model_id": "m", "ext_ml_model_version": "1"}

    @app.task(bind=True, name="ml.infer", shared=False, ml=infer_ml)
    def infer(self: Any, x: int, load_s: float = 0.2) -> dict[str, Any]:
        """A GPU inference request: CUDA at first use, then the model from the child's cache."""
        from celery_ojs_ml import model
        from celery_ojs_ml.child import models

        with _CUDA_LOCK:
            if "cvd" not in _FIRST_GPU_USE:
                init_fake_cuda()
                _FIRST_GPU_USE["cvd"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        before = models.stats()["loads"]
        net = model(self, ("m", "1"), lambda: time.sleep(load_s) or {"pid": os.getpid()})
        entry = {
            "tag": "infer",
            "task_id": self.request.id,
            "pid": os.getpid(),
            "loaded": models.stats()["loads"] > before,
            "net_pid": net["pid"],
            "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "first_cvd": _FIRST_GPU_USE.get("cvd"),
            "y": x * 2,
        }
        _record(results_url, entry)
        return entry

    @app.task(bind=True, name="ml.verified_load", shared=False, ml={"ext_ml_gpu_count": 1})
    def verified_load(self: Any, path: str) -> int:
        """Verify the model file against the job's ext_ml_model_checksum, then 'load' it."""
        from celery_ojs_ml.child.model_files import verify_model

        verify_model(self, path)
        return len(Path(path).read_bytes())

    @app.task(bind=True, name="ml.dedup_echo", shared=False, ml={"ext_ml_gpu_count": 1},
              ml_dedup={"window_s": 3})  # fmt: skip
    def dedup_echo(self: Any, x: int) -> dict[str, Any]:
        """An inference request deduplicated for 3 s (OJS ML §14.6)."""
        entry = {"tag": "dedup", "task_id": self.request.id, "x": x, "y": x * 10}
        _record(results_url, entry)
        return entry


def _define_hold_task(app: Celery, results_url: str) -> None:
    @app.task(bind=True, name="ml.hold", shared=False, ml={"ext_ml_gpu_count": 1})
    def hold(self: Any, tag: str, limit_s: float = 60.0) -> dict[str, Any]:
        """Holds its GPU until the test sets `HOLD_KEY + tag` (or `limit_s` passes), so a
        test orders events by what it saw, not by a sleep that a loaded machine outruns."""
        start = time.time()
        client = redis.Redis.from_url(results_url)
        try:
            while not client.exists(HOLD_KEY + tag) and time.time() - start < limit_s:
                time.sleep(0.02)
        finally:
            client.close()
        entry = {"tag": tag, "task_id": self.request.id, "start": start, "end": time.time()}
        _record(results_url, entry)
        return entry


def _define_plain_tasks(app: Celery, results_url: str) -> None:
    @app.task(bind=True, name="plain.sleep", shared=False)
    def sleep(self: Any, tag: str, sleep_s: float) -> None:
        start = time.time()
        time.sleep(sleep_s)
        entry = {"tag": tag, "task_id": self.request.id, "start": start, "end": time.time()}
        _record(results_url, {**entry, "worker": self.request.hostname})

    @app.task(bind=True, name="plain.add", shared=False)
    def add(self: Any, a: int, b: int) -> dict[str, Any]:
        entry = {
            "tag": "plain",
            "task_id": self.request.id,
            "sum": a + b,
            "queue": self.request.delivery_info.get("routing_key"),
            "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "headers": sorted(k for k in (self.request.headers or {}) if k.startswith("ojs")),
        }
        _record(results_url, entry)
        return entry


app = make_app(os.environ.get("OJS_TEST_BROKER", "redis://127.0.0.1:6399/0"))


def _count_leaked_requests() -> None:
    """`OJS_TEST_GC_REQUESTS=1`: the worker's main process runs without the cyclic
    collector from ready to shutdown, then logs how many Celery requests only that
    collector could have freed (requests held in a reference cycle)."""
    import gc
    import sys

    from celery import signals

    def ready(**_: Any) -> None:
        gc.collect()
        gc.disable()

    def report(**_: Any) -> None:
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        leaked = sum(type(o).__name__ == "Request" for o in gc.garbage)
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
        print(f"ojs-test: requests in reference cycles: {leaked}", file=sys.stderr, flush=True)

    signals.worker_ready.connect(ready, weak=False)
    signals.worker_shutdown.connect(report, weak=False)


if os.environ.get("OJS_TEST_GC_REQUESTS") == "1":
    _count_leaked_requests()
