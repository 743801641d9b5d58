"""A producer cannot steer the plugin through its private headers (`wire.headers.PRIVATE`).

Only the plugin sets the `ojs_*` headers that pick a job's devices, GPU share,
assignment, grant, rendezvous, crash and preemption counters or checkpoint. A
producer that sets them on a call (by mistake or on purpose) gets a job that runs
exactly as it would without them: the router strips them, and the worker's gate
computes its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h
from tests.integration.mlapp import make_app
from tests.integration.test_fleet import _result, _results, _wait, _worker
from tests.integration.workers import running

pytestmark = pytest.mark.integration

FORGED: dict[str, Any] = {
    h.DEVICES: [5],
    h.NODE: "evil@test",
    h.PIN: [5],
    h.LEASE: "forged-lease",
    h.SHARE: {"fraction": 0.5, "vram_gb": 1, "mps_limit": "0=1G"},
    h.TPU_CHIPS: [3],
    h.BATCH: {"requests": [{"id": "someone-else", "args": [], "kwargs": {}}], "events": False},
    h.CPUS: [7],
    h.MEMORY_LIMIT: 0.001,
    h.ASSIGN: "forged-token",
    h.VICTIMS: ["someone-else"],
    h.PREFETCH: 1,
    h.GRANT: "forged-epoch",
    h.GRANT_AT: 1.0,
    h.SUBMITTED: 1.0,
    h.RENDEZVOUS: {"addr": "10.9.9.9", "port": 29999, "size": 2, "rank": 1},
    h.CRASHES: 7,
    h.PREEMPTIONS: 3,
    h.LAST_CHECKPOINT: {"seq": 9, "uri": "file:///etc/"},
    h.CLASS: "forged-class",
    h.BAND: "reserved",
    h.PENDING: "forged reason",
    h.WAKE: "evil@test",
    h.MSG: "forged-message-id",
}


def test_every_private_header_is_listed_as_private() -> None:
    assert set(FORGED) == set(h.PRIVATE) - {h.GANG}, "a private header this test does not forge"


def test_a_job_published_with_forged_private_headers_runs_as_if_they_were_not_there(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An `ojs_wake` header alone would have made the leader's intake drop the job as a
    wake-up; `ojs_devices` would have asked for a device the worker does not have."""
    conf = json.dumps({"ojs_ml_heartbeat_s": 0.5, "ojs_ml_grants": False})
    monkeypatch.setenv("OJS_TEST_CONF", conf)
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    one = _worker("one", redis_url, "nvidia-a100x1", tmp_path, conc=1, OJS_TEST_CONF=conf)
    with running([one], store):
        job = record.apply_async(args=["forged", 0.0], headers=dict(FORGED)).id
        done = _wait(lambda: _result(redis_client, job), 30, "the job with forged headers")
    assert done["devices"] == [0]
    assert done["cvd"] == "0"
    assert done["worker"] == "one@test"
    assert done["share"] is None
    assert done["master_addr"] is None
    assert done["grant"] is None
    assert done["assigned"] is True  # by the leader's own token
    assert (done["crashes"], done["preemptions"], done["last_checkpoint"]) == (0, 0, None)
    app.close()


def test_a_plain_task_with_forged_private_headers_gets_no_devices_and_no_share(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = json.dumps({"ojs_ml_heartbeat_s": 0.5})
    monkeypatch.setenv("OJS_TEST_CONF", conf)
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    add = app.tasks["plain.add"]
    one = _worker("one", redis_url, "nvidia-a100x1", tmp_path, conc=1, OJS_TEST_CONF=conf)
    with running([one], store):
        control = add.apply_async(args=[1, 1]).id
        forged = add.apply_async(args=[2, 2], headers=dict(FORGED)).id
        _wait(lambda: _result(redis_client, control), 30, "the plain task")
        _wait(lambda: _result(redis_client, forged), 30, "the plain task with forged headers")
    by_id = {r["task_id"]: r for r in _results(redis_client)}
    assert by_id[forged]["sum"] == 4
    assert by_id[forged]["cvd"] == by_id[control]["cvd"]
    assert by_id[forged]["queue"] == by_id[control]["queue"]
    app.close()
