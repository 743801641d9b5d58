"""The Redis intake (DESIGN decision 9, invariant 5: no job is lost).

The leader moves intake messages atomically into a processing list and takes
them off only once their jobs are admitted, so a leader killed at any instant
loses none (kombu's own consumer pops with BRPOP first: kombu#305). These tests
also pin the kombu Redis layout that `store.broker` reads (checked
against kombu 5.7.0): they fail when it changes.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Producer  # type: ignore[attr-defined]
from kombu.transport import redis as kombu_redis

from celery_ojs_ml.store import broker as redis_intake
from celery_ojs_ml.store.broker import PROCESSING_SUFFIX, RedisIntake
from celery_ojs_ml.store.pending import HEADER_MSG
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.queues import intake_name, ml_queue
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess

pytestmark = pytest.mark.integration

QUEUE = "ojs.ml.intake"


@pytest.fixture
def channel(redis_url: str, redis_client: redis.Redis) -> Iterator[object]:
    with Connection(redis_url) as conn:  # type: ignore[no-untyped-call]
        yield conn.channel()


def _publish(channel: object, task_id: str, priority: int | None = None) -> None:
    producer = Producer(channel)  # type: ignore[no-untyped-call]
    props = {} if priority is None else {"priority": priority}
    producer.publish(
        [[task_id], {}, {}],
        exchange=ml_queue(QUEUE).exchange,
        routing_key=QUEUE,
        declare=[ml_queue(QUEUE)],
        headers={"id": task_id, "task": "t"},
        serializer="json",
        **props,
    )


def test_kombu_keeps_each_priority_step_in_its_own_list_as_the_intake_reads_them(
    channel: object, redis_client: redis.Redis
) -> None:
    assert redis_intake.supports(channel)
    assert "for pri in self.priority_steps" in inspect.getsource(kombu_redis.Channel._brpop_start)
    assert "lpush(key" in inspect.getsource(kombu_redis.Channel._put)
    for task_id, priority in (("low", 0), ("mid", 5), ("high", 9)):
        _publish(channel, task_id, priority)
    keys = {k for k in redis_client.keys(f"{QUEUE}*") if redis_client.type(k) == b"list"}
    assert keys == {QUEUE.encode(), f"{QUEUE}\x06\x163".encode(), f"{QUEUE}\x06\x169".encode()}
    payload = json.loads(redis_client.lindex(f"{QUEUE}\x06\x163", 0) or b"{}")
    assert payload["properties"]["body_encoding"] == "base64"
    assert payload["headers"]["id"] == "mid" and payload["content-type"] == "application/json"

    intake = RedisIntake(channel, QUEUE, batch=64)
    messages = intake.pop(0.0)
    assert [m.headers["id"] for m in messages] == ["low", "mid", "high"]  # kombu's key order
    assert json.loads(messages[1].body)[0] == ["mid"]
    assert messages[1].properties["priority"] == 5 and messages[1].content_type
    assert redis_client.llen(QUEUE + PROCESSING_SUFFIX) == 3  # taken, not yet settled


def test_what_a_reader_took_and_did_not_settle_is_recovered_by_the_next_one_in_order(
    channel: object, redis_client: redis.Redis
) -> None:
    for n in range(4):
        _publish(channel, f"job-{n}")
    first = RedisIntake(channel, QUEUE, batch=3)
    taken = first.pop(0.0)
    assert [m.headers["id"] for m in taken] == ["job-0", "job-1", "job-2"]
    taken[1].ack()
    first.done()
    first.close()  # as if killed: job-0 and job-2 were never settled
    second = RedisIntake(channel, QUEUE, batch=3)
    assert [m.headers["id"] for m in second.recover()] == ["job-0", "job-2"]
    assert [m.headers["id"] for m in second.pop(0.0)] == ["job-3"]
    assert redis_client.llen(QUEUE) == 0


def test_settling_in_the_leaders_assignment_pipeline_takes_only_acked_messages_off(
    channel: object, redis_client: redis.Redis
) -> None:
    """With the store on the broker's Redis the leader settles the admitted messages in
    its assignments' pipeline (`done_in`): one round trip fewer per pass."""
    for n in range(3):
        _publish(channel, f"job-{n}")
    reader = RedisIntake(channel, QUEUE, batch=3)
    taken = reader.pop(0.0)
    taken[0].ack()
    taken[2].ack()
    with redis_client.pipeline(transaction=False) as pipe:
        reader.done_in(pipe)
        assert len(pipe.command_stack) == 2
        pipe.execute()
    assert reader.settled == []
    reader.close()  # as if killed: job-1 was never settled
    again = RedisIntake(channel, QUEUE, batch=3)
    assert [m.headers["id"] for m in again.recover()] == ["job-1"]


def test_a_blocked_read_returns_a_message_published_meanwhile_and_an_empty_one_returns_none(
    channel: object, redis_url: str
) -> None:
    intake = RedisIntake(channel, QUEUE, batch=8)
    began = time.monotonic()
    assert intake.pop(0.1) == []
    assert time.monotonic() - began >= 0.09  # it did wait
    with Connection(redis_url) as other:  # type: ignore[no-untyped-call]
        _publish(other.channel(), "late")
    assert [m.headers["id"] for m in intake.pop(1.0)] == ["late"]


def test_a_wake_up_pushed_by_a_worker_wakes_a_blocked_reader_as_a_kombu_publish_would(
    channel: object, redis_client: redis.Redis, redis_url: str
) -> None:
    """`wake_message` on the list the reader blocks on is read as a kombu-published wake-up
    (the worker pushes it with the store's client, in its advertisement's round trip)."""
    app = Celery("wake", broker=redis_url, set_as_current=False)
    from celery_ojs_ml import OJSML

    OJSML(app)
    key = redis_intake.wake_list(app, QUEUE)
    assert key == QUEUE, "a plain Redis broker that is also the store: the priority-0 list"
    intake = RedisIntake(channel, QUEUE, batch=8)
    assert key == intake.keys[0], "the list the reader blocks on"
    OJSStore(redis_client, prefix="ojs").advertise(
        "w@host", {}, {}, push=(key, redis_intake.wake_message("w@host"))
    )
    woken = intake.pop(1.0)
    assert [m.headers.get(redis_intake.WAKE_HEADER) for m in woken] == ["w@host"]
    assert woken[0].body == b""
    app.close()


@pytest.mark.parametrize(
    ("conf", "direct"),
    [
        ({}, True),
        ({"ojs_ml_store_url": "redis://127.0.0.1:1/5"}, False),
        ({"broker_transport_options": {"global_keyprefix": "p:"}}, False),
        ({"broker_url": "amqp://guest:guest@127.0.0.1:5672//"}, False),
    ],
)
def test_wake_ups_are_pushed_directly_only_where_the_store_is_the_brokers_redis(
    redis_url: str, conf: dict[str, object], direct: bool
) -> None:
    app = Celery("wake", broker=redis_url, set_as_current=False)
    app.conf.update(conf)
    from celery_ojs_ml import OJSML

    OJSML(app)
    assert (redis_intake.wake_list(app, QUEUE) is not None) is direct
    app.close()


def test_a_message_that_is_not_kombu_json_is_dropped_not_raised(
    channel: object, redis_client: redis.Redis
) -> None:
    redis_client.lpush(QUEUE, b"\xff not json")
    intake = RedisIntake(channel, QUEUE, batch=8)
    assert intake.pop(0.0) == []
    intake.done()
    assert redis_client.llen(QUEUE + PROCESSING_SUFFIX) == 0


@pytest.mark.timeout(120)
def test_a_job_taken_by_a_leader_that_died_before_admitting_it_runs_once_under_the_next(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The kill test's old loss window, made deterministic: a leader took the message
    off the intake and died; the next leader finds it in the processing list."""
    store = OJSStore(redis_client, prefix="ojs")
    app: Celery = make_app(redis_url)
    name = intake_name(app.ojs_ml.settings.store_prefix)
    worker = WorkerProcess("next", redis_url, "profile:nvidia-a100x1", tmp_path)
    try:
        job = app.tasks["ml.record"].apply_async(args=["orphan", 0.0])
        with app.connection_for_write() as conn:
            dead = RedisIntake(conn.channel(), name, batch=8)
            taken = dead.pop(0.0)
        assert [m.headers["id"] for m in taken] == [job.id]
        assert isinstance(taken[0].headers.get(HEADER_MSG), str)  # stamped at publish
        assert redis_client.llen(name) == 0 and redis_client.llen(name + PROCESSING_SUFFIX) == 1
        worker.start().wait_live(store)
        deadline = time.monotonic() + 60
        while redis_client.llen(RESULTS_KEY) < 1:
            assert time.monotonic() < deadline, worker.output()[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)  # a second run would show up here
        records = [json.loads(r) for r in redis_client.lrange(RESULTS_KEY, 0, -1)]
        assert [r["task_id"] for r in records] == [job.id]
        assert redis_client.llen(name + PROCESSING_SUFFIX) == 0
        assert "an earlier leader took" in worker.output()
    finally:
        worker.stop()
        app.close()


def test_status_counts_the_jobs_the_intake_holds_waiting_and_taken(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """`celery ojs-ml status` (the scheduler part) says how many jobs wait to be admitted."""
    from celery_ojs_ml.cli.sched import intake_depth

    app: Celery = make_app(redis_url)
    try:
        assert intake_depth(app.ojs_ml) == {"waiting": 0, "taken": 0}
        for n in range(3):
            app.tasks["ml.record"].apply_async(args=[f"job-{n}", 0.0])
        assert intake_depth(app.ojs_ml) == {"waiting": 3, "taken": 0}
        with app.connection_for_write() as conn:
            name = intake_name(app.ojs_ml.settings.store_prefix)
            assert len(RedisIntake(conn.channel(), name, batch=2).pop(0.0)) == 2
        assert intake_depth(app.ojs_ml) == {"waiting": 1, "taken": 2}
    finally:
        app.close()


@pytest.mark.parametrize("priority", [None, 0, 5])
def test_a_delivery_pushed_by_the_leader_is_what_a_kombu_publish_pushes(
    channel: object, redis_client: redis.Redis, priority: int | None
) -> None:
    """`redis_intake.envelope` (the leader's Lua push of an assignment) against kombu's own
    publish to the default exchange (checked against kombu 5.7.0): same list, same message
    but for the delivery tag, which kombu makes unique per publish."""
    queue = "ojs.ml.w.a@h"
    props: dict[str, Any] = {"correlation_id": "t1", "reply_to": "r", "delivery_mode": 2}
    props |= {"delivery_info": {"exchange": "ojs.ml.intake", "routing_key": "ojs.ml.intake"}}
    if priority is not None:
        props["priority"] = priority
    headers = {"id": "t1", "task": "t", "ojs_assign": "tok"}
    body = b'[["x"], {}, {}]'
    Producer(channel).publish(  # type: ignore[no-untyped-call]
        body, exchange="", routing_key=queue, headers=headers,
        content_type="application/json", content_encoding="utf-8", **dict(props),
    )  # fmt: skip
    keys = [k.decode() for k in redis_client.keys(queue + "*")]
    assert len(keys) == 1
    kombu_raw = json.loads(redis_client.lpop(keys[0]) or b"")
    key, raw = redis_intake.envelope(
        channel, queue, body, headers, props, "application/json", "utf-8"
    )
    ours = json.loads(raw)
    assert key == keys[0]
    for doc in (kombu_raw, ours):
        assert doc["properties"].pop("delivery_tag")
    assert ours == kombu_raw


def test_a_wake_up_ends_the_leaders_gap_between_passes_and_an_arrival_does_not(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The gap after a pass that started nothing batches arrivals into a full fleet; a
    worker's wake-up (capacity freed) ends it, so the capacity is filled at once
    (`FleetScheduler.step`, `Intake.sit_out`)."""
    from celery_ojs_ml import OJSML
    from celery_ojs_ml.leader.loop import FleetScheduler

    app = Celery("gap", broker=redis_url, set_as_current=False)
    OJSML(app)
    leader = FleetScheduler(app, candidate="leader-under-test")
    leader.intake.connect()
    try:
        intake = leader.link.queue
        assert intake == QUEUE
        leader.step(0)  # the first pass: nothing waits
        leader._last_pass, leader._gap_s = time.monotonic(), 0.3
        with Connection(redis_url) as other:  # type: ignore[no-untyped-call]
            _publish(other.channel(), "arrival-without-a-class")  # read, refused, not a wake
        began = time.monotonic()
        leader.step(0)
        assert time.monotonic() - began >= 0.29, "an arrival does not end the gap"
        assert not leader.intake.woken
        assert redis_client.llen(intake) == 0, "the arrival was read during the gap"
        OJSStore(redis_client, prefix="ojs").advertise(
            "w@host", {}, {}, push=(intake, redis_intake.wake_message("w@host"))
        )
        leader._last_pass, leader._gap_s = time.monotonic(), 30.0
        began = time.monotonic()
        leader.step(0)
        assert leader.intake.woken
        assert time.monotonic() - began < 10.0, "the wake-up ended a 30 s gap"
    finally:
        leader.close()
        app.close()


def _publish_to(channel: object, queue: str, task_id: str, headers: dict[str, Any]) -> None:
    producer = Producer(channel)  # type: ignore[no-untyped-call]
    producer.publish(
        [[task_id], {}, {}],
        exchange=ml_queue(queue).exchange,
        routing_key=queue,
        declare=[ml_queue(queue)],
        headers={"id": task_id, "task": "t", **headers},
        serializer="json",
    )


def test_a_revoked_grant_moves_only_granted_messages_from_the_holders_queue_to_the_intake(
    channel: object, redis_client: redis.Redis
) -> None:
    """`sweep_granted` reads kombu's lists of a worker's own queue (kombu 5.7.0 layout):
    the granted messages go to the intake oldest first; an assignment stays."""
    own = "ojs.ml.w.holder@test"
    _publish_to(channel, own, "g1", {"ojs_grant": "e1"})
    _publish_to(channel, own, "a1", {"ojs_grant": "e1", "ojs_assign": "tok"})
    _publish_to(channel, own, "g2", {"ojs_grant": "e1"})
    moved = redis_intake.sweep_granted(redis_client, channel, own, QUEUE, "ojs_grant", "ojs_assign")
    assert moved == 2
    assert [json.loads(r)["headers"]["id"] for r in redis_client.lrange(own, 0, -1)] == ["a1"]
    taken = RedisIntake(channel, QUEUE, batch=8).pop(0.0)
    assert [m.headers["id"] for m in taken] == ["g1", "g2"]  # in publish order


def test_a_dead_holders_unacked_granted_messages_go_back_to_the_intake(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """`restore_granted` reads kombu's unacked hash (`[message, exchange, routing key]` by
    delivery tag, kombu 5.7.0): a message a consumer took and never acked goes to the
    intake, once, and leaves kombu's bookkeeping so that kombu does not restore it too."""
    own = "ojs.ml.w.dead@test"
    with Connection(redis_url) as conn:  # type: ignore[no-untyped-call]
        channel = conn.channel()
        for task_id, extra in (("g1", {"ojs_grant": "e1"}), ("a1", {"ojs_assign": "t"})):
            _publish_to(channel, own, task_id, extra)
        taken: list[Any] = []
        consumer = conn.Consumer(
            [ml_queue(own)], callbacks=[lambda _b, m: taken.append(m)], accept=["json"]
        )
        consumer.qos(prefetch_count=10)
        with consumer:
            deadline = time.monotonic() + 5
            while len(taken) < 2 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError, OSError):
                    conn.drain_events(timeout=0.2)
        assert len(taken) == 2 and redis_client.hlen("unacked") == 2  # taken, never acked
        args = (redis_client, channel, own, QUEUE, "ojs_grant", "ojs_assign")
        assert redis_intake.restore_granted(*args) == 1
        assert redis_intake.restore_granted(*args) == 0  # once
        assert redis_client.hlen("unacked") == 1 and redis_client.zcard("unacked_index") == 1
        back = RedisIntake(channel, QUEUE, batch=8).pop(0.0)
        assert [m.headers["id"] for m in back] == ["g1"]
        assert json.loads(back[0].body)[0] == ["g1"]  # the body survives the move
