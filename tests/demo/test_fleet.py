"""The Redis mode's pieces that need no worker: the worker command line and the clean-up."""

from __future__ import annotations

import json

import fakeredis

from celery_ojs_ml.demo.fleet import discard_waiting, worker_argv
from celery_ojs_ml.demo.jobs import DemoJob
from celery_ojs_ml.demo.watch import DONE, WAITING, Row
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.queues import queue_name


def test_a_demo_worker_is_a_prefork_celery_worker_with_a_simulated_profile() -> None:
    argv = worker_argv("a100@demo", "profile:nvidia-a100x8", 4)
    assert argv[1:6] == ["-m", "celery", "-A", "celery_ojs_ml.demo.app", "worker"]
    assert argv[argv.index("-P") + 1] == "prefork"
    assert argv[argv.index("-n") + 1] == "a100@demo"
    assert argv[-1] == "--ojs-ml-capabilities=profile:nvidia-a100x8"


def _message(task_id: str) -> str:
    return json.dumps({"body": "", "headers": {"id": task_id, "task": "ml.train"}})


def test_clean_up_removes_only_the_waiting_jobs_messages_and_pending_records() -> None:
    client = fakeredis.FakeRedis()
    store = OJSStore(client, prefix="ojs")
    queue = queue_name("gpu-training", "c0ffee", "on-demand")
    client.rpush(queue, _message("other-producers-job"), _message("mine"))
    client.rpush(queue + "\x06\x166", _message("mine-too"))  # a kombu priority step
    for task_id in ("mine", "mine-too"):
        record = {"reason": "0/3", "class_id": "c0ffee", "band": "on-demand"}
        store.set_pending(task_id, {**record, "queue": "gpu-training"})
    nowhere = frozenset[str]()
    rows = [
        Row(DemoJob("mine", "zz", "ml.train", "on-demand", nowhere), WAITING, reason="0/3"),
        Row(DemoJob("mine-too", "zz2", "ml.train", "on-demand", nowhere), WAITING, reason="0/3"),
        Row(DemoJob("done", "ok", "ml.train", "on-demand", frozenset({"a"})), DONE),
    ]
    assert discard_waiting(store, rows) == 2
    left = [json.loads(m)["headers"]["id"] for m in client.lrange(queue, 0, -1)]
    assert left == ["other-producers-job"]
    assert client.llen(queue + "\x06\x166") == 0
    assert store.pending() == {}
