"""Priority escalation (OJS ML §8.4) on a real worker, against a stream of on-demand jobs.

One 1-GPU worker; on-demand jobs of 0.5 s keep arriving, three always waiting.
A spot job alone would never start (every on-demand job goes first). With
`ext_ml_priority_escalation` after 2 s to `reserved`, it starts within 2 s plus
two on-demand jobs' run time: the one running, and at most one held ahead at the
gate that starts before the pass that escalates takes it back (`leader.prefetch`
`unhold`). The slack covers the scheduler interval (0.5 s) twice and the hand-off,
on a loaded 2-core machine. Without escalation it would not start within the 12 s
the stream runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

AFTER_S, RUN_S, SLACK_S = 2, 0.5, 2.0
ESCALATING = {
    "ext_ml_priority_class": "spot",
    "ext_ml_priority_escalation": True,
    "ext_ml_escalation_after_s": AFTER_S,
    "ext_ml_escalation_target_class": "reserved",
}


def _results(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(r) for r in client.lrange(RESULTS_KEY, 0, -1)]


def test_an_escalating_spot_job_starts_within_its_escalation_time_plus_one_job_under_a_stream(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    worker = WorkerProcess("one", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2)
    with running([worker], store):
        stream: list[str] = []

        def top_up() -> None:
            done = {r["task_id"] for r in _results(redis_client)}
            while sum(1 for i in stream if i not in done) < 4:  # one running, three waiting
                stream.append(record.apply_async(args=["od", RUN_S]).id)

        top_up()
        time.sleep(1.0)
        sent = time.time()
        spot = record.apply_async(args=["esc", 0.1], headers=ESCALATING).id
        deadline = time.monotonic() + AFTER_S + 10
        while time.monotonic() < deadline:
            if any(r["task_id"] == spot for r in _results(redis_client)):
                break
            top_up()
            time.sleep(0.05)
        time.sleep(1.0)  # let the stream's last jobs finish
    runs = {r["task_id"]: r for r in _results(redis_client)}
    assert spot in runs, "the escalating job never started under the stream"
    took = runs[spot]["start"] - sent
    assert took <= AFTER_S + 2 * RUN_S + SLACK_S, took
    assert took >= AFTER_S - 0.1, "it started before it escalated: the stream did not block it"
    assert f"{spot} escalated from spot to reserved (OJS ML §8.4)" in worker.output()
    app.close()
