"""Anti-affinity against running jobs (OJS ML §7.3) on real workers: replicas spread.

Three idle 2-GPU workers. Best fit alone would pack two 1-GPU replicas on one
worker; the replicas' required anti-affinity on their own label
`app=llm-serve` (declared per call in `ojs_labels`) keeps each on a different
worker, and a fourth waits for one to end rather than join another replica.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

REPLICA = {
    "ext_ml_gpu_count": 1,
    "ext_ml_anti_affinity": {
        "required": [{"key": "app", "operator": "In", "values": ["llm-serve"]}]
    },
    "ojs_labels": {"app": "llm-serve"},
}


def _results(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(r) for r in client.lrange(RESULTS_KEY, 0, -1)]


def test_replicas_with_required_anti_affinity_run_on_different_workers(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    workers = [
        WorkerProcess(n, redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=3)
        for n in ("a", "b", "c")
    ]
    with running(workers, store):
        ids = [record.apply_async(args=[f"r{i}", 2.0], headers=REPLICA).id for i in range(4)]
        deadline = time.monotonic() + 30
        while len(_results(redis_client)) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
    runs = {r["task_id"]: r for r in _results(redis_client)}
    assert sorted(runs) == sorted(ids)
    first = [runs[i] for i in ids[:3]]
    assert sorted(r["worker"] for r in first) == ["a@test", "b@test", "c@test"]
    for x in runs.values():
        for y in runs.values():
            overlap = x["start"] < y["end"] and y["start"] < x["end"]
            if x is not y and overlap:
                assert x["worker"] != y["worker"], "two replicas ran on one worker at once"
    app.close()


def test_labels_that_are_not_a_mapping_of_strings_are_refused_at_publish_naming_them(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = make_app(redis_url)
    before = redis_client.llen("ojs.ml.intake")
    with pytest.raises(SpecError, match="ojs_labels is"):
        app.tasks["ml.record"].apply_async(args=["x"], headers={"ojs_labels": ["app"]})
    assert redis_client.llen("ojs.ml.intake") == before, "nothing was published"
    app.close()


def test_a_tasks_ml_labels_option_and_the_calls_labels_are_published_together(
    redis_url: str, redis_client: redis.Redis
) -> None:
    app = make_app(redis_url)

    @app.task(name="ml.labelled", shared=False, ml={"ext_ml_gpu_count": 1}, ml_labels={"app": "a"})  # type: ignore[untyped-decorator]
    def labelled() -> None:
        """Never run: the test reads its published message."""

    labelled.apply_async(headers={"ojs_labels": {"tier": "gold", "app": "b"}})
    [raw] = redis_client.lrange("ojs.ml.intake", 0, -1)
    assert json.loads(raw)["headers"]["ojs_labels"] == {"app": "b", "tier": "gold"}
    app.close()
