"""A real worker keeps serving whatever a producer or an operator sends it.

Every message here reaches a real prefork worker on a private Redis: the
app's own bounds decide what it runs, a message it cannot run ends in a
terminal state with a reason (dead-lettered, failed in the result backend),
and a valid job published right after still runs.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ojs_ml.spec.classes import class_id
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.store.deadletter import dead_jobs
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.queues import ml_queue, queue_name
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

CONF = {
    "ojs_ml_protected_label_keys": [],
    "ojs_ml_model_registry_schemes": ["hf", "https"],
}
CAPS = {
    "accelerator": "gpu",
    "gpu": {"type": "nvidia-l4", "count": 1, "memory_gb": 24},
    "cpu_cores": 8,
    "memory_gb": 32,
    "labels": {"cost_center": "ml-research"},
}


@pytest.fixture(scope="module")
def client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="module")
def ojs_store(client: redis.Redis) -> OJSStore:
    return OJSStore(client, prefix="ojs")


@pytest.fixture(scope="module")
def app(redis_url: str, client: redis.Redis) -> Iterator[Celery]:
    app = make_app(redis_url, **CONF)
    yield app
    app.close()


@pytest.fixture(scope="module")
def foreign(redis_url: str) -> Iterator[Celery]:
    """A producer without the plugin: its messages reach a queue exactly as written."""
    app = Celery("foreign", broker=redis_url, set_as_current=False)
    yield app
    app.close()


@pytest.fixture(scope="module")
def worker(
    redis_url: str, ojs_store: OJSStore, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    logdir = tmp_path_factory.mktemp("hardening")
    proc = WorkerProcess(
        "hard",
        redis_url,
        json.dumps(CAPS),
        logdir,
        concurrency=2,
        extra_env={"OJS_TEST_CONF": json.dumps(CONF)},
    )
    with running([proc], ojs_store):
        yield proc


def _wait_tag(client: redis.Redis, tag: str, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for raw in client.lrange(RESULTS_KEY, 0, -1):
            entry = json.loads(raw)
            if entry.get("tag") == tag:
                return dict(entry)
        time.sleep(0.05)
    raise AssertionError(f"task {tag!r} never ran")


def _wait_all_acked(client: redis.Redis, timeout: float = 10.0) -> None:
    """Every message is acked. A job's body writes its tag before the worker acks it, so a
    test that has just seen the tag polls; a message left hanging still fails, naming it."""
    deadline = time.monotonic() + timeout
    while client.hlen("unacked") and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [json.loads(raw)[0].get("headers", {}).get("id") for raw in client.hvals("unacked")]
    assert not left, f"messages never acked: {left}"


def _entries(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(RESULTS_KEY, 0, -1)]


def _run_valid(app: Celery, client: redis.Redis, worker: WorkerProcess) -> dict[str, Any]:
    """A valid GPU job runs: the worker is up and still serving."""
    tag = f"valid-{uuid.uuid4().hex[:6]}"
    app.tasks["ml.record"].apply_async(args=[tag], kwargs={"cuda": False})
    entry = _wait_tag(client, tag)
    assert worker.proc is not None and worker.proc.poll() is None
    return entry


def test_a_worker_uses_the_apps_bounds_for_a_label_the_operator_unprotected(
    app: Celery, client: redis.Redis, worker: WorkerProcess
) -> None:
    """§15.4 labels are protected by default; an operator who lists none lets jobs select them."""
    app.tasks["ml.record"].apply_async(
        args=["cost-center"], headers={"ext_ml_node_selector": {"cost_center": "ml-research"}}
    )
    assert _wait_tag(client, "cost-center")["devices"] == [0]
    _run_valid(app, client, worker)


def test_a_worker_uses_the_apps_bounds_for_a_registry_scheme_the_operator_allowed(
    app: Celery, client: redis.Redis, worker: WorkerProcess
) -> None:
    app.tasks["ml.record"].apply_async(
        args=["https-model"],
        headers={"ext_ml_model_registry_uri": "https://models.example.com/llama"},
    )
    assert _wait_tag(client, "https-model")["devices"] == [0]
    assert "Traceback" not in worker.output()


def _class_queue() -> tuple[str, str]:
    cid = class_id(normalize({"ext_ml_gpu_count": 1}).requirements)
    return cid, queue_name("celery", cid, "on-demand")


def _send_foreign(foreign: Celery, task: str, tag: str, headers: dict[str, Any]) -> str:
    task_id = f"foreign-{tag}-{uuid.uuid4().hex[:6]}"
    foreign.send_task(
        task,
        args=[tag],
        kwargs={"cuda": False},
        task_id=task_id,
        headers=headers,
        queue=ml_queue("ojs.ml.w.hard@test"),
    )  # fmt: skip  (straight to the worker's own queue: the gate is the last line)
    return task_id


def _base_headers() -> dict[str, Any]:
    cid, _ = _class_queue()
    return {"ojs_class": cid, "ojs_band": "on-demand", "ext_ml_gpu_count": 1}


REFUSED = {
    "an-unknown-class": ({"ojs_class": "0123456789abcdef"}, "does not match"),
    "a-class-that-is-not-a-string": ({"ojs_class": ["x"]}, "must be a class id string"),
    "requirements-out-of-bounds": ({"ext_ml_gpu_count": -1}, "invalid requirements"),
    "a-crash-counter-that-is-text": ({"ojs_crashes": "many"}, "ojs_crashes must be an integer"),
    "a-negative-preemption-counter": ({"ojs_preemptions": -4}, "ojs_preemptions must be"),
    "a-checkpoint-that-is-not-an-object": (
        {"ojs_last_checkpoint": "file:///etc/shadow"},
        "ojs_last_checkpoint must be a checkpoint record",
    ),
    "an-oversized-header": ({"ext_ml_model_id": "m" * 200_000}, "over ojs_ml_max_header_bytes"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_malformed_message_is_dead_lettered_failed_and_the_worker_keeps_serving(
    case: str,
    app: Celery,
    foreign: Celery,
    client: redis.Redis,
    ojs_store: OJSStore,
    worker: WorkerProcess,
) -> None:
    _run_valid(app, client, worker)  # the class queue exists and the worker consumes it
    bad, reason = REFUSED[case]
    task_id = _send_foreign(foreign, "ml.record", case, {**_base_headers(), **bad})
    deadline = time.monotonic() + 20
    while task_id not in {d["task_id"] for d in dead_jobs(ojs_store)}:
        assert time.monotonic() < deadline, worker.output()[-3000:]
        time.sleep(0.05)
    dead = next(d for d in dead_jobs(ojs_store) if d["task_id"] == task_id)
    assert reason in dead["reason"]
    result = app.AsyncResult(task_id)
    # The gate dead-letters the job first (it is kept even if the worker dies next), then
    # fails its result: on a loaded machine the test can read between the two writes.
    while result.state != "FAILURE" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert result.state == "FAILURE" and reason in str(result.result)
    assert not any(json.loads(r)["tag"] == case for r in client.lrange(RESULTS_KEY, 0, -1))
    _run_valid(app, client, worker)
    _wait_all_acked(client)  # the message was taken off the broker, not left hanging


def test_forged_device_and_lease_headers_are_dropped_and_the_gate_pins_its_own(
    app: Celery, foreign: Celery, client: redis.Redis, worker: WorkerProcess
) -> None:
    _run_valid(app, client, worker)
    forged = {"ojs_devices": [7, 99], "ojs_pin": True, "ojs_node": "x", "ojs_lease": {"t": 1}}
    _send_foreign(foreign, "ml.record", "forged-ml", {**_base_headers(), **forged})
    entry = _wait_tag(client, "forged-ml")
    assert (entry["devices"], entry["worker"]) == ([0], "hard@test")
    foreign.send_task("plain.add", args=[1, 2], headers=forged, queue="celery")
    deadline = time.monotonic() + 20
    while True:
        plain = [json.loads(r) for r in client.lrange(RESULTS_KEY, 0, -1)]
        found = [p for p in plain if p.get("tag") == "plain"]
        if found:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert found[0]["cvd"] is None  # a plain task is never pinned by a producer's header
    assert found[0]["headers"] == []


def test_a_queue_with_ml_defaults_turns_its_plain_tasks_into_ml_jobs(
    redis_url: str, client: redis.Redis, worker: WorkerProcess
) -> None:
    """OJS ML §10.1 MUST: a queue's ml_defaults apply to every job sent to it."""
    defaults = {"ext_ml_gpu_count": 1, "ext_ml_gpu_type": "nvidia-l4"}
    producer = make_app(redis_url, ojs_ml_queue_policies={"gpu": {"ml_defaults": defaults}})
    try:
        job = producer.tasks["plain.add"].apply_async(args=[1, 1], queue="gpu")
        cid = class_id(normalize(defaults).requirements)
        book = PendingBook(OJSStore(client, prefix="ojs"))
        deadline = time.monotonic() + 10
        while (record := book.get(job.id)) is None:  # admitted by the scheduler from its intake
            assert time.monotonic() < deadline, "the job never reached the pending set"
            time.sleep(0.05)
        headers = record["msg"]["headers"]
        assert (headers["ext_ml_gpu_type"], headers["ojs_class"]) == ("nvidia-l4", cid)
        assert client.llen("gpu") == 0
        producer.tasks["plain.add"].apply_async(args=[20, 22], queue="celery")
        deadline = time.monotonic() + 20
        while not (found := [e for e in _entries(client) if e.get("sum") == 42]):
            assert time.monotonic() < deadline, "the plain task never ran"
            time.sleep(0.05)
        assert found[0]["headers"] == []  # a queue without ml_defaults stays plain Celery
    finally:
        producer.close()


def test_the_worker_log_has_no_traceback_after_the_hostile_messages(worker: WorkerProcess) -> None:
    assert worker.proc is not None and worker.proc.poll() is None
    assert "Unrecoverable error" not in worker.output()
    assert os.path.exists(worker.log)
