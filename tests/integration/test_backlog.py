"""A backlog larger than the leader's window (`scheduler.window`), with a real worker.

Between full passes the leader decides the first `ojs_ml_queue_depth` jobs in order
from its window (the first 4 x queue_depth jobs at its last complete ordering) plus
every job that arrived or changed since. These tests make the window small
(queue depth 5: a window of 20) and full passes rare (60 s), put 60 spot jobs in
the backlog, and check that a job arriving behind them, and one reordered deep
inside them (RFC 27 prioritize), are still decided in their place in fleet order.

The bound: when the job is published, one job runs on the 1-GPU worker and at most
`ojs_ml_prefetch` (2) wait ahead at its gate; a pass already under way may assign
one more. So at most 4 backlog jobs start after it is published and before it. A
window that missed it would let about 15 more start (until the window runs out).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_ojs_ml.cli.main import cli
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from tests.integration.mlapp import make_app
from tests.integration.test_fleet import RESERVED, SPOT, _result, _results, _wait, _worker
from tests.integration.workers import running

pytestmark = pytest.mark.integration

BACKLOG = 60
AHEAD_AT_MOST = 4
CONF = json.dumps({"ojs_ml_queue_depth": 5, "ojs_ml_full_pass_s": 60})


def _started_between(results: list[dict], after: float, before: float) -> list[str]:  # type: ignore[type-arg]
    return [r["tag"] for r in results if r["tag"].startswith("s") and after < r["start"] < before]


def test_a_job_behind_a_backlog_larger_than_the_window_starts_in_its_place_in_order(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=False)
    one = _worker("one", redis_url, "nvidia-a100x1", tmp_path, OJS_TEST_CONF=CONF)
    with running([one], store):
        spot = [record.apply_async(args=[f"s{n}", 0.1], headers=SPOT).id for n in range(BACKLOG)]
        _wait(lambda: PendingBook(store).get(spot[-1]), 20, "the backlog to be admitted")
        _wait(lambda: len(_results(redis_client)) >= 3, 20, "the backlog to start")
        sent = time.time()
        reserved = record.apply_async(args=["reserved", 0.1], headers=RESERVED).id
        _wait(lambda: _result(redis_client, reserved), 30, "the reserved job")
        last = spot[-1]
        asked = time.time()
        result = CliRunner().invoke(cli, ["prioritize", last, "9"], obj=obj)
        assert result.exit_code == 0, result.output
        _wait(lambda: len(_results(redis_client)) == BACKLOG + 1, 60, "every job")
    results = _results(redis_client)
    assert sorted(r["task_id"] for r in results) == sorted([*spot, reserved]), "lost or twice"
    by_id = {r["task_id"]: r for r in results}
    before = _started_between(results, sent, by_id[reserved]["start"])
    assert len(before) <= AHEAD_AT_MOST, f"backlog jobs started before the reserved one: {before}"
    if by_id[last]["start"] > asked:  # not already started when it was prioritized
        before = _started_between(results, asked, by_id[last]["start"])
        assert len(before) <= AHEAD_AT_MOST, f"jobs started before the prioritized one: {before}"
    app.close()
