"""The leader's fast lane (`leader.lane`): an arrival at a quiet fleet is decided on
the fleet the last quiet pass read, with its admission and assignment in one pipeline.

A real `FleetScheduler` on a private Redis; the workers are advertisements written the
way a worker's gate writes them (an `Allocator` snapshot of a capability profile).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_ojs_ml import OJSML
from celery_ojs_ml.allocator.core import Allocator
from celery_ojs_ml.allocator.model import Allocation
from celery_ojs_ml.capabilities import capabilities_to_dict, resolve_capabilities
from celery_ojs_ml.leader.loop import FleetScheduler
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.store import broker as redis_intake
from celery_ojs_ml.store.broker import PROCESSING_SUFFIX
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.queues import worker_queue_name
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration

BIG, SMALL = "big@host", "small@host"


def _advertise(store: OJSStore, name: str, profile: str, wake: bool = False) -> None:
    """A worker's advertisement (with its wake-up, as a gate that freed capacity sends)."""
    caps = resolve_capabilities(profile)
    push = ("ojs.ml.intake", redis_intake.wake_message(name)) if wake else None
    store.advertise(
        name,
        capabilities_to_dict(caps),
        Allocator(caps).snapshot(),
        ttl_s=60,
        info={"pinning": True, "queues": ["celery"]},
        push=push,
    )


_APPS: list[Celery] = []


@pytest.fixture
def fleet(redis_url: str, redis_client: redis.Redis) -> Iterator[tuple[Celery, FleetScheduler]]:
    app = Celery("lane", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.task_create_missing_queues = True
    OJSML(app)

    @app.task(name="lane.one", shared=False, ml={"ext_ml_gpu_count": 1})  # type: ignore[untyped-decorator]
    def one() -> None:
        return None

    @app.task(name="lane.eight", shared=False, ml={"ext_ml_gpu_count": 8})  # type: ignore[untyped-decorator]
    def eight() -> None:
        return None

    _APPS.append(app)
    store = OJSStore(redis_client, prefix="ojs")
    _advertise(store, BIG, "profile:nvidia-a100x8")
    _advertise(store, SMALL, "profile:nvidia-a100x1")
    leader = FleetScheduler(app, candidate="lane-leader")
    assert leader.book.lead(leader.candidate, 30)
    leader.intake.connect()
    try:
        yield app, leader
    finally:
        leader.close()
        _APPS.remove(app)
        app.close()


def _placed(leader: FleetScheduler, task_id: str) -> tuple[Any, Any]:
    """The job's pending record's (state, worker); (None, None) when there is none."""
    record = PendingBook(leader.store).get(task_id) or {}
    return record.get("state"), record.get("worker")


def _delivered(client: redis.Redis, worker: str) -> list[dict[str, Any]]:
    raws = client.lrange(worker_queue_name("ojs", worker), 0, -1)
    return [json.loads(raw) for raw in raws]


def test_a_job_arriving_at_a_quiet_fleet_is_assigned_in_the_lane_to_its_best_fit(
    fleet: tuple[Celery, FleetScheduler], redis_client: redis.Redis
) -> None:
    app, leader = fleet
    leader.step(0)  # a quiet pass: nothing waits, the fleet is kept
    assert leader.lane.kept is not None
    passes = leader.passes
    job = app.tasks["lane.one"].apply_async()
    leader.step(1.0)
    assert leader.lane_passes == 1 and leader.passes == passes, "decided without a full pass"
    record = PendingBook(leader.store).get(job.id)
    assert record is not None and record["state"] == "assigned"
    assert record["worker"] == SMALL, "best fit: the 1-GPU worker, not the 8-GPU one"
    (msg,) = _delivered(redis_client, SMALL)
    assert msg["headers"]["id"] == job.id
    assert msg["headers"][h.ASSIGN] == record["token"], "delivered with its token"
    assert _delivered(redis_client, BIG) == []
    leader.link.settle()
    assert redis_client.llen(leader.link.queue + PROCESSING_SUFFIX) == 0, "its message settled"

    # one use: the next arrival (the fleet changed) takes a full pass, which places the
    # 8-GPU job on the 8-GPU worker as at once
    big = app.tasks["lane.eight"].apply_async()
    leader.step(1.0)
    assert leader.lane_passes == 1 and leader.passes == passes + 1
    assert _placed(leader, big.id) == ("assigned", BIG)


def test_a_wake_up_ends_the_lane_and_the_next_arrival_takes_a_full_pass(
    fleet: tuple[Celery, FleetScheduler], redis_client: redis.Redis
) -> None:
    app, leader = fleet
    leader.step(0)
    assert leader.lane.kept is not None
    _advertise(leader.store, SMALL, "profile:nvidia-a100x1", wake=True)  # capacity changed
    leader.intake.read(1.0, 64)
    assert leader.intake.woken and leader.lane.kept is None
    passes = leader.passes
    job = app.tasks["lane.one"].apply_async()
    leader.step(1.0)
    assert leader.lane_passes == 0 and leader.passes > passes
    assert _placed(leader, job.id) == ("assigned", SMALL)


def test_a_job_that_cannot_start_now_is_left_to_a_full_pass_which_says_why_it_waits(
    fleet: tuple[Celery, FleetScheduler], redis_client: redis.Redis
) -> None:
    app, leader = fleet
    caps = resolve_capabilities("profile:nvidia-a100x8")
    busy = Allocator(caps)  # every GPU of the 8-GPU worker allocated, as its heartbeat shows
    req = MLRequirements(ext_ml_gpu_count=8, ext_ml_gpu_type="nvidia-a100")
    assert isinstance(busy.try_alloc("running", "running", req), Allocation)
    leader.store.advertise(
        BIG, capabilities_to_dict(caps), busy.snapshot(), ttl_s=60, info={"pinning": True}
    )
    leader.step(0)
    assert leader.lane.kept is not None
    passes = leader.passes
    job = app.tasks["lane.eight"].apply_async()
    leader.step(1.0)
    assert leader.lane_passes == 0, "a job that must wait is not decided in the lane"
    assert leader.passes == passes + 1
    record = PendingBook(leader.store).get(job.id)
    assert record is not None and record["state"] == "pending"
    assert "gpu_count free 0 < 8" in record["annotation"]["reason_pending"], "annotated"
    assert _delivered(redis_client, BIG) == [] and _delivered(redis_client, SMALL) == []


def test_a_job_admitted_after_a_pass_read_the_fleet_is_not_overtaken_by_the_next_arrival(
    fleet: tuple[Celery, FleetScheduler], redis_client: redis.Redis
) -> None:
    """Policy rule 1 (order). A new leader's first admission (or any after a Redis restart)
    finds the server without the script and admits the arrivals after the pass's reads.
    That pass saw nothing waiting; had it kept its fleet as quiet, the next arrival would
    have taken the lane to the GPUs the earlier job waits for."""
    app, leader = fleet
    redis_client.script_flush()  # as on a restarted server, or before a first use
    first = app.tasks["lane.eight"].apply_async()
    leader.step(1.0)  # the leader's first pass: no lane yet, a full pass
    assert _placed(leader, first.id) == ("pending", None), "admitted, not yet decided"
    assert leader.lane.kept is None, "a pass that admitted jobs after its reads is not quiet"
    assert leader._dirty, "the late jobs are decided by a pass at once"
    second = app.tasks["lane.eight"].apply_async()
    leader.step(1.0)
    leader.step(0)
    assert _placed(leader, first.id) == ("assigned", BIG), "the first arrival goes first"
    assert _placed(leader, second.id) == ("pending", None), "the later one waits for it"


@pytest.mark.parametrize(
    ("conf", "lane"),
    [
        ({"ojs_ml_fair_share": {"train": 2.0}}, False),
        ({"ojs_ml_prefetch": 4}, True),
        ({"ojs_ml_prefetch": 0}, True),
    ],
    ids=["fair-share-shut", "prefetch-open", "no-prefetch-open"],
)
def test_the_lane_stays_shut_where_the_full_pass_must_account_for_every_job(
    redis_url: str, redis_client: redis.Redis, conf: dict[str, Any], lane: bool
) -> None:
    """Fair-share weights need the full pass's accounting; prefetch does not (a fleet
    with a job delivered ahead is not quiet: the job is in the ledger until it starts)."""
    app = Celery("shut", broker=redis_url, set_as_current=False)
    app.conf.update(conf)
    OJSML(app)
    _APPS.append(app)
    _advertise(OJSStore(redis_client, prefix="ojs"), SMALL, "profile:nvidia-a100x1")
    leader = FleetScheduler(app, candidate="shut-leader")
    assert leader.book.lead(leader.candidate, 30)
    leader.intake.connect()
    try:
        leader.step(0)
        assert (leader.lane.kept is not None) is lane
    finally:
        leader.close()
        _APPS.remove(app)
        app.close()


def test_a_worker_wakes_the_leader_when_it_joins(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A worker joining is capacity the kept fleet lacks: it wakes the leader, which
    ends the lane and passes at once (a waiting job starts on the new worker without
    waiting for the scheduler's interval)."""
    store = OJSStore(redis_client, prefix="ojs")
    worker = WorkerProcess(
        "joiner",
        redis_url,
        "profile:nvidia-a100x1",
        tmp_path,
        concurrency=1,
        extra_env={"OJS_TEST_CONF": json.dumps({"ojs_ml_scheduler": "off"})},
    )

    def wakes() -> list[str]:
        raws = redis_client.lrange("ojs.ml.intake", 0, -1)
        return [json.loads(r)["headers"].get(redis_intake.WAKE_HEADER) for r in raws]

    with running([worker], store):
        assert wakes() == [worker.hostname], "joined: one wake-up, with its advertisement"
    assert worker.hostname not in store.live_workers()
    assert wakes() == [worker.hostname], "a warm shutdown leaves nothing on the intake"


def test_a_job_the_lane_gave_a_worker_that_left_is_taken_back_and_runs_elsewhere(
    fleet: tuple[Celery, FleetScheduler], redis_client: redis.Redis
) -> None:
    """A warm shutdown sends no wake-up: the lane may still pick the worker that left.
    The next pass finds it gone, takes the job back (token-fenced) and places it on a
    live worker; the stale copy cannot start."""
    app, leader = fleet
    leader.step(0)
    assert leader.lane.kept is not None
    leader.store.forget_worker(SMALL)  # what a warm shutdown does
    job = app.tasks["lane.one"].apply_async()
    leader.step(1.0)
    assert leader.lane_passes == 1
    assert _placed(leader, job.id) == ("assigned", SMALL)
    stale = (PendingBook(leader.store).get(job.id) or {})["token"]
    leader.step(0)  # the next pass: SMALL is gone, the job taken back and placed again
    assert _placed(leader, job.id) == ("assigned", BIG)
    assert (PendingBook(leader.store).get(job.id) or {})["token"] != stale
    assert PendingBook(leader.store).start(job.id, stale, SMALL) == "stale"
