"""Reservations (OJS ML §8.3) on real workers: reserved capacity is held idle for its jobs.

Two idle 4-GPU workers. `ml.reserve` holds 4 GPUs; the scheduler places the
reservation on one worker and its gate holds them. A stream of outside 1-GPU
jobs then runs only on the other worker (without the reservation best fit
would use both), the reserved 4-GPU job starts at once inside the
reservation, and a job naming an unknown reservation is refused at publish.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.store.reservations import ReservationBook
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration


def _results(client: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(r) for r in client.lrange(RESULTS_KEY, 0, -1)]


def _held(store: OJSStore, rid: str, timeout_s: float = 20.0) -> str:
    """Wait until the reservation is placed and its worker's gate reports holding it."""
    book = ReservationBook(store)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = book.get(rid) or {}
        worker = record.get("worker")
        if worker:
            live = store.live_workers().get(worker) or {}
            if rid in ((live.get("free") or {}).get("reservations") or {}):
                return str(worker)
        time.sleep(0.1)
    raise AssertionError(f"reservation {rid} was never placed and held: {book.get(rid)}")


def test_no_job_outside_a_reservation_touches_its_gpus_and_the_reserved_job_starts_at_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """§8.3: never dispatched outside the pool; nothing else uses it while it is held."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    workers = [
        WorkerProcess(n, redis_url, "profile:nvidia-a100x4", tmp_path, concurrency=6)
        for n in ("a", "b")
    ]
    with running(workers, store):
        rid = app.ojs_ml.reserve({"ext_ml_gpu_count": 4}, reservation_id="train-8", timeout_s=120)
        home = _held(store, rid)
        outside = [record.apply_async(args=[f"o{i}", 1.0]).id for i in range(10)]
        time.sleep(1.5)  # the stream is running: 4 at a time on the free worker
        sent = time.time()
        inside = record.apply_async(
            args=["inside", 0.5], headers={"ext_ml_gpu_count": 4, "ext_ml_reservation_id": rid}
        ).id
        deadline = time.monotonic() + 40
        while len(_results(redis_client)) < 11 and time.monotonic() < deadline:
            time.sleep(0.1)
        listing = app.ojs_ml.reservations()
        assert app.ojs_ml.release(rid) is True
        assert app.ojs_ml.release(rid) is False  # already ended
    runs = {r["task_id"]: r for r in _results(redis_client)}
    assert sorted(runs) == sorted([*outside, inside]), "every job ran exactly once"
    assert {runs[i]["worker"] for i in outside} == {_other(home)}, (
        "an outside job used the reservation"
    )
    assert runs[inside]["worker"] == home and len(runs[inside]["devices"]) == 4
    assert runs[inside]["start"] - sent < 2.0, "the reserved job did not start at once"
    assert listing[rid]["state"] == "placed" and listing[rid]["worker"] == home
    app.close()


def test_a_job_naming_an_unknown_or_ended_reservation_is_refused_at_publish(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """§8.3 MUST verify the reservation exists and can hold the job; nothing is published."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    with pytest.raises(SpecError) as unknown:
        record.apply_async(args=["x"], headers={"ext_ml_reservation_id": "nope"})
    assert "ext_ml_reservation_id" in str(unknown.value) and "does not exist" in str(unknown.value)
    rid = app.ojs_ml.reserve({"ext_ml_gpu_count": 2})
    with pytest.raises(SpecError) as too_big:
        record.apply_async(
            args=["x"], headers={"ext_ml_gpu_count": 4, "ext_ml_reservation_id": rid}
        )
    assert "needs more gpus than reservation" in str(too_big.value)
    app.ojs_ml.release(rid)
    with pytest.raises(SpecError) as ended:
        record.apply_async(args=["x"], headers={"ext_ml_reservation_id": rid})
    assert "has ended (released)" in str(ended.value)
    assert PendingBook(store).records() == {}
    assert redis_client.llen("ojs.ml.intake") == 0, "something was published"
    app.close()


def test_a_job_waiting_in_a_reservation_that_ends_fails_with_the_reason(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """§8.3: it may not run elsewhere, so it is denied (failed, dead-lettered), not lost."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x4", tmp_path, concurrency=4)
    with running([worker], store):
        rid = app.ojs_ml.reserve({"ext_ml_gpu_count": 1}, timeout_s=60)
        _held(store, rid)
        headers = {"ext_ml_gpu_count": 1, "ext_ml_reservation_id": rid}
        first = record.apply_async(args=["in1", 3.0], headers=headers)
        second = record.apply_async(args=["in2", 0.1], headers=headers)  # waits for in1
        time.sleep(1.0)
        app.ojs_ml.release(rid)
        assert first.get(timeout=20)["tag"] == "in1"  # a running job is never killed by it
        with pytest.raises(Exception) as failed:
            second.get(timeout=20)
    assert "ended" in str(failed.value) and "§8.3" in str(failed.value)
    app.close()


def test_the_section_8_3_chain_prep_on_cpu_while_the_reservation_holds_the_training_gpus(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """§8.3 workflow case (examples/reservation_pipeline.py): a stream of other GPU jobs
    fills every free GPU while data prep runs; the training step still starts at once."""
    store = OJSStore(redis_client, prefix="ojs")
    app = make_app(redis_url)
    record, add = app.tasks["ml.record"], app.tasks["plain.add"]
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x8", tmp_path, concurrency=12)
    with running([worker], store):
        rid = app.ojs_ml.reserve({"ext_ml_gpu_count": 4}, timeout_s=120)
        _held(store, rid)
        others = [record.apply_async(args=[f"o{i}", 2.0]).id for i in range(12)]
        train = record.si("train", 0.2).set(
            headers={"ext_ml_gpu_count": 4, "ext_ml_reservation_id": rid}
        )
        sent = time.time()  # without the reservation, 8 outside jobs hold every GPU for 2 s
        pipeline = (add.si(1, 2) | train).apply_async()
        found = pipeline.get(timeout=30)
        done = time.time()
        deadline = time.monotonic() + 40
        while len([r for r in _results(redis_client) if r["tag"] != "plain"]) < 13:
            assert time.monotonic() < deadline, "not every job ran"
            time.sleep(0.1)
    runs = [r for r in _results(redis_client) if r["tag"] not in ("plain", "train")]
    assert sorted(r["task_id"] for r in runs) == sorted(others)
    assert found["tag"] == "train" and len(found["devices"]) == 4
    assert len([r for r in _results(redis_client) if r["tag"] == "plain"]) == 1  # prep ran
    assert found["start"] - sent < 1.5, "training waited for GPUs"
    overlapping = [r for r in runs if r["start"] < found["end"] and found["start"] < r["end"]]
    assert len(overlapping) <= 4, "outside jobs used more than the 4 unreserved GPUs"
    assert done >= found["end"]
    app.close()


def _other(name: str) -> str:
    return "b@test" if name == "a@test" else "a@test"
