"""The Celery app the chaos campaign's workers run (`bench/chaos.py`).

`celery -A bench.chaos_app worker ...` reads its servers from the environment:
`CHAOS_BROKER`, `CHAOS_STORE` (a worker's own proxy to the store), `CHAOS_LEDGER` (the
never-faulted ledger, also the result backend), `CHAOS_CKPT` (checkpoint directory) and
`CHAOS_CONF` (JSON settings). Every task body records its attempt in the ledger list
`chaos:events`: `start`, `progress` after each committed checkpoint, and `end`, each with
the job, a fresh attempt id, worker, pid, counters and time, so the campaign can tell
lost jobs, overlapping attempts and double completions from outside.

Training bodies behave as a careful user's do: a save or resume that fails because the
store does not answer is tried again (a training run outlives a store restart), and the
last save is final (`save(final=True, result=...)`).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import redis
from celery import Celery

from celery_ojs_ml import OJSML
from celery_ojs_ml.checkpoint import CheckpointError

EVENTS = "chaos:events"
PREFIX = "ojs"
STORE_RETRY_S = 120.0
"""How long a training body keeps trying a save or a resume while the store is away."""
_T = TypeVar("_T")
_CLIENT: dict[int, redis.Redis] = {}


def ckpt_dir() -> str:
    return os.environ.get("CHAOS_CKPT", "/tmp/ojs-chaos-ckpt")


def train_ml(band: str) -> dict[str, Any]:
    """The ML attributes of a checkpointed training job in `band`."""
    return {
        "ext_ml_gpu_count": 1,
        "ext_ml_priority_class": band,
        "ext_ml_checkpoint_enabled": True,
        "ext_ml_checkpoint_storage_uri": f"file://{ckpt_dir()}/",
        "ext_ml_checkpoint_max_count": 2,
        "ext_ml_checkpoint_interval_s": 1,
        "ext_ml_checkpoint_on_preempt": True,
        "ext_ml_preemption_grace_period_s": 10,
    }


def make_app(
    broker: str, store: str | None, ledger: str | None, conf: dict[str, Any] | None = None
) -> Celery:
    """The app; `ledger` is the result backend (None: the publisher, which reads the
    results from the ledger itself and needs no result subscriptions)."""
    app = Celery("chaos", broker=broker, backend=ledger, set_as_current=False)
    app.conf.update(
        task_create_missing_queues=True,
        worker_prefetch_multiplier=1,
        result_expires=None,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": 10,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 5,
        },
        ojs_ml_store_url=store,
        ojs_ml_store_prefix=PREFIX,
        ojs_ml_subscription_poll_s=0.2,
        ojs_ml_heartbeat_s=0.5,
        ojs_ml_lease_ttl_s=3,
        ojs_ml_leader_ttl_s=3,
        ojs_ml_assignment_timeout_s=10,
        ojs_ml_max_crashes=100,
        ojs_ml_min_runtime_before_preemption_s=2,
        ojs_ml_advertise_address="127.0.0.1",
        ojs_ml_checkpoint_prefixes=[f"file://{ckpt_dir()}/"],
    )
    app.conf.update(conf if conf is not None else json.loads(os.environ.get("CHAOS_CONF", "{}")))
    OJSML(app)
    _define_tasks(app)
    return app


def ledger() -> redis.Redis:
    """This process's client on the ledger (a fresh one after a fork)."""
    client = _CLIENT.get(os.getpid())
    if client is None:
        client = _CLIENT[os.getpid()] = redis.Redis.from_url(os.environ["CHAOS_LEDGER"])
    return client


def note(task: Any, attempt: str, ev: str, **fields: Any) -> None:
    """One ledger event of this attempt."""
    req = task.request
    entry = {
        "ev": ev,
        "job": req.id,
        "attempt": attempt,
        "t": time.time(),
        "worker": getattr(req, "ojs_node", None),
        "pid": os.getpid(),
        "crashes": int(getattr(req, "ojs_crashes", 0) or 0),
        "preemptions": int(getattr(req, "ojs_preemptions", 0) or 0),
        "grant": bool(getattr(req, "ojs_grant", None)),
        **fields,
    }
    ledger().rpush(EVENTS, json.dumps(entry))


def patiently(call: Callable[[], _T]) -> _T:
    """`call()`, tried again while the store does not answer (up to `STORE_RETRY_S`)."""
    deadline = time.monotonic() + STORE_RETRY_S
    while True:
        try:
            return call()
        except (redis.ConnectionError, redis.TimeoutError, CheckpointError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _define_tasks(app: Celery) -> None:
    from celery_ojs_ml import checkpoint

    @app.task(bind=True, name="chaos.train", shared=False, ml=train_ml("on-demand"))
    def train(self: Any, epochs: int, epoch_s: float) -> dict[str, Any]:
        """Checkpointed training: resume, an epoch per `epoch_s`, a save per epoch."""
        attempt = uuid.uuid4().hex
        note(self, attempt, "start")
        ckpt = checkpoint(self)
        last = patiently(ckpt.resume)
        start = (last.epoch + 1) if last and last.epoch is not None else 0
        result = {"epochs": epochs}
        for epoch in range(start, epochs):
            time.sleep(epoch_s)
            final = epoch == epochs - 1
            files = {"state.json": json.dumps({"epoch": epoch}).encode()}
            patiently(partial(ckpt.save, epoch=epoch, files=files, final=final, result=result))
            note(self, attempt, "progress", epoch=epoch, resumed=start)
            if not final:
                ckpt.yield_if_preempted()
        note(self, attempt, "end", resumed=start)
        return result

    @app.task(bind=True, name="chaos.infer", shared=False, ml={"ext_ml_gpu_count": 1})
    def infer(self: Any, x: int, ms: float) -> dict[str, Any]:
        """A short inference request: no checkpoint, at-least-once."""
        attempt = uuid.uuid4().hex
        note(self, attempt, "start")
        time.sleep(ms / 1000)
        note(self, attempt, "end")
        return {"y": 2 * x}

    gang_ml = {**train_ml("on-demand"), "ext_ml_gpu_count": 0, "ext_ml_cpu_cores": 1}
    del gang_ml["ext_ml_checkpoint_on_preempt"], gang_ml["ext_ml_preemption_grace_period_s"]

    @app.task(bind=True, name="chaos.gang", shared=False, ml=gang_ml)
    def gang(self: Any, epochs: int, epoch_s: float) -> dict[str, Any]:
        """One rank of a 2-rank data-parallel run (gloo): an all-reduce and a save per epoch,
        resuming from the earliest epoch any rank committed."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        attempt = uuid.uuid4().hex
        note(self, attempt, "start", rank=int(os.environ["RANK"]))
        ckpt = checkpoint(self)
        last = patiently(ckpt.resume)
        mine = (last.epoch + 1) if last and last.epoch is not None else 0
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=30))
        try:
            agreed = torch.tensor([float(mine)])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            start = int(agreed.item())
            result = {"epochs": epochs}
            for epoch in range(start, epochs):
                value = torch.tensor([1.0])
                dist.all_reduce(value)
                time.sleep(epoch_s)
                final = epoch == epochs - 1
                patiently(partial(ckpt.save, epoch=epoch, final=final, result=result))
                note(self, attempt, "progress", epoch=epoch, resumed=start)
        finally:
            dist.destroy_process_group()
        note(self, attempt, "end", resumed=start)
        return result


if "CHAOS_BROKER" in os.environ:  # a worker (or its scheduler candidate): the app it runs
    app = make_app(
        os.environ["CHAOS_BROKER"], os.environ.get("CHAOS_STORE"), os.environ["CHAOS_LEDGER"]
    )
