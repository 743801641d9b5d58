"""Arbitrary `ojs_*` and `ext_ml_*` headers sent to a real worker never stop it or lose a job.

Each generated message goes, exactly as a foreign producer would write it (no
router), alternately to the fleet scheduler's intake queue and straight to the
own queue of a real prefork worker (its gate). The
worker must stay up; every such message must end somewhere (it ran, or it was
refused with a reason in the dead-letter set); and a valid job sent after each
one must still run.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_ojs_ml.spec.classes import class_id
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import KNOWN_KEYS
from celery_ojs_ml.store.deadletter import dead_jobs
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.queues import ml_queue
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

CID = class_id(normalize({"ext_ml_gpu_count": 1}).requirements)
QUEUES = ("ojs.ml.intake", "ojs.ml.w.fuzz@test")
OJS_KEYS = [
    "ojs_class", "ojs_band", "ojs_logical_queue", "ojs_pending", "ojs_devices", "ojs_node",
    "ojs_pin", "ojs_lease", "ojs_last_checkpoint", "ojs_crashes", "ojs_preemptions",
    "ojs_assign", "ojs_victims",
]  # fmt: skip

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
header_keys = (
    st.sampled_from(OJS_KEYS)
    | st.sampled_from(sorted(KNOWN_KEYS))
    | st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12).map(lambda s: "ojs_" + s)
)
headers = st.dictionaries(header_keys, json_values, max_size=6).map(
    lambda h: {"ojs_class": CID, "ext_ml_gpu_count": 1, **h}
)


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
def apps(redis_url: str, client: redis.Redis) -> Iterator[tuple[Celery, Celery]]:
    app = make_app(redis_url)
    foreign = Celery("foreign", broker=redis_url, set_as_current=False)
    yield app, foreign
    app.close()
    foreign.close()


@pytest.fixture(scope="module")
def worker(
    redis_url: str, ojs_store: OJSStore, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    logdir = tmp_path_factory.mktemp("fuzz-worker")
    proc = WorkerProcess("fuzz", redis_url, "profile:nvidia-l4x1", logdir, concurrency=2)
    with running([proc], ojs_store):
        yield proc


def _tags(client: redis.Redis) -> set[str]:
    return {json.loads(raw)["tag"] for raw in client.lrange(RESULTS_KEY, 0, -1)}


def _wait_for(client: redis.Redis, tag: str, worker: WorkerProcess) -> None:
    deadline = time.monotonic() + 20
    while tag not in _tags(client):
        assert worker.proc is not None and worker.proc.poll() is None, worker.output()[-3000:]
        assert time.monotonic() < deadline, f"valid job {tag} never ran:\n{worker.output()[-3000:]}"
        time.sleep(0.02)


SENT: list[str] = []


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(garbage=headers)
def test_arbitrary_ojs_headers_never_stop_the_worker_and_valid_jobs_still_run(
    garbage: dict[str, Any],
    apps: tuple[Celery, Celery],
    client: redis.Redis,
    worker: WorkerProcess,
) -> None:
    app, foreign = apps
    if not SENT:  # the first valid job registers the class, so the worker consumes its queue
        warm = f"warm-{uuid.uuid4().hex[:6]}"
        app.tasks["ml.record"].apply_async(args=[warm], kwargs={"cuda": False})
        _wait_for(client, warm, worker)
    tag = f"fuzz-{uuid.uuid4().hex[:8]}"
    SENT.append(tag)
    foreign.send_task(
        "ml.record", args=[tag], kwargs={"cuda": False}, task_id=tag, headers=garbage,
        queue=ml_queue(QUEUES[len(SENT) % 2]),
    )  # fmt: skip
    valid = f"valid-{uuid.uuid4().hex[:6]}"
    app.tasks["ml.record"].apply_async(args=[valid], kwargs={"cuda": False})
    _wait_for(client, valid, worker)


def test_every_fuzzed_message_either_ran_or_was_refused_with_a_reason(
    client: redis.Redis, ojs_store: OJSStore, worker: WorkerProcess
) -> None:
    assert SENT, "the fuzz test above must run first"
    deadline = time.monotonic() + 20
    while True:
        dead = {d["task_id"]: d["reason"] for d in dead_jobs(ojs_store)}
        waiting = set(PendingBook(ojs_store).records())  # valid, but no worker can run it
        lost = [t for t in SENT if t not in _tags(client) and t not in dead and t not in waiting]
        if not lost or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not lost, f"{len(lost)} fuzzed messages neither ran, waited nor were refused: {lost[:5]}"
    assert all(
        r.startswith(("refused by fuzz@test: ", "refused by the scheduler: "))
        for r in dead.values()
    )
    assert "Traceback" not in worker.output()
