"""`ojs_ml_prefetch` on a real worker: jobs delivered ahead of capacity wait at the gate
and start as soon as a job ends; every job still runs exactly once."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_ojs_ml.pending import PendingBook
from celery_ojs_ml.store import OJSStore
from tests.integration.mlapp import RESULTS_KEY, make_app
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration


def test_prefetched_jobs_wait_at_the_gate_and_every_job_runs_once(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    app = make_app(redis_url)
    conf = json.dumps({"ojs_ml_prefetch": 2})
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=3,
                           extra_env={"OJS_TEST_CONF": conf})  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        ids = [app.tasks["ml.record"].apply_async(args=[f"p{i}", 0.3]).id for i in range(10)]
        deadline = time.monotonic() + 60
        while redis_client.llen(RESULTS_KEY) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # nothing runs twice afterwards
    runs = [json.loads(r) for r in redis_client.lrange(RESULTS_KEY, 0, -1)]
    assert sorted(r["task_id"] for r in runs) == sorted(ids), "a job was lost or ran twice"
    for r in runs:  # never more than 2 GPUs in use at any instant
        at_once = [o for o in runs if o["start"] <= r["start"] < o["end"]]
        assert len(at_once) <= 2, at_once
    log = (tmp_path / "a.log").read_text()
    assert "ojs-ml: holding" in log, "no job was delivered ahead of capacity"
    app.close()


def test_a_prefetched_job_is_taken_back_when_another_worker_can_start_it_first(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The job reserved (and prefetched) on the worker whose job's time limit ends first
    does not wait there when the other worker frees earlier: the leader takes it back."""
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    # max_hold_s 30: `next`'s planned start (the long job's limit, 6.5 s away) counts as soon
    conf = json.dumps({"ojs_ml_prefetch": 1, "ojs_ml_max_hold_s": 30})
    env = {"OJS_TEST_CONF": conf}
    workers = [
        WorkerProcess(
            name, redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2, extra_env=env
        )
        for name in ("a", "b")
    ]
    with running(workers, OJSStore(redis_client, prefix="ojs")):
        long = record.apply_async(args=["long", 6.0], headers={"ext_ml_timeout_seconds": 8})
        time.sleep(1.0)
        short = record.apply_async(args=["short", 1.5], headers={"ext_ml_timeout_seconds": 300})
        time.sleep(0.5)
        nxt = record.apply_async(args=["next", 0.1])
        deadline = time.monotonic() + 60
        while redis_client.llen(RESULTS_KEY) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
    runs = {r["task_id"]: r for r in map(json.loads, redis_client.lrange(RESULTS_KEY, 0, -1))}
    assert sorted(runs) == sorted([long.id, short.id, nxt.id]), runs
    assert runs[long.id]["worker"] != runs[short.id]["worker"]
    assert runs[nxt.id]["worker"] == runs[short.id]["worker"], runs
    assert runs[nxt.id]["start"] < runs[long.id]["end"], "it waited for the long job"
    logs = "".join((tmp_path / f"{w}.log").read_text() for w in ("a", "b"))
    assert f"took prefetched {nxt.id} back" in logs
    app.close()


def test_a_job_published_later_in_a_higher_band_starts_before_a_job_prefetched_ahead_of_it(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Order rule 1 with prefetch: a spot job waits at the only worker's gate behind a
    running one; a reserved-band job published next must start first. The leader takes
    the spot job back (the gate would start it the moment the GPU frees)."""
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    conf = json.dumps({"ojs_ml_prefetch": 1})
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2,
                           extra_env={"OJS_TEST_CONF": conf})  # fmt: skip
    spot = {"ext_ml_priority_class": "spot"}
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        # a time limit within max_hold_s / 2: the job after it is likely to start soon
        first = record.apply_async(
            args=["first", 2.5], headers={**spot, "ext_ml_timeout_seconds": 4}
        )
        time.sleep(0.6)
        cheap = record.apply_async(args=["cheap", 0.2], headers=spot)
        deadline = time.monotonic() + 10
        log = tmp_path / "a.log"
        while f"holding {cheap.id}" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"holding {cheap.id}" in log.read_text(), "the spot job was not sent ahead"
        urgent = record.apply_async(
            args=["urgent", 0.2], headers={"ext_ml_priority_class": "reserved"}
        )
        deadline = time.monotonic() + 60
        while redis_client.llen(RESULTS_KEY) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
    runs = {r["task_id"]: r for r in map(json.loads, redis_client.lrange(RESULTS_KEY, 0, -1))}
    assert sorted(runs) == sorted([first.id, cheap.id, urgent.id]), "a job was lost or ran twice"
    assert runs[urgent.id]["start"] < runs[cheap.id]["start"], "the spot job overtook it"
    assert f"took prefetched {cheap.id} back" in log.read_text()
    app.close()


def test_a_prefetching_worker_reads_that_many_more_messages_ahead(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A running ML job's message stays unacked until its lease is written (a short job:
    until it ends), so each running job takes one unit of the consumer's prefetch count.
    With `-c` as many processes as GPUs, a prefetched message would then only be read
    once a job ended. `ojs_ml_prefetch = N` raises the count by N (`MLWorker._open_prefetch`)."""
    app = make_app(redis_url)
    env = {"OJS_TEST_CONF": json.dumps({"ojs_ml_prefetch": 3})}
    workers = [
        WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2,
                      extra_env=env),
        WorkerProcess("b", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=2,
                      extra_env={"OJS_TEST_CONF": json.dumps({"ojs_ml_prefetch": 0})}),
    ]  # fmt: skip
    with running(workers, OJSStore(redis_client, prefix="ojs")):
        stats: dict[str, Any] = {}
        deadline = time.monotonic() + 15
        while len(stats) < 2 and time.monotonic() < deadline:
            stats = app.control.inspect(timeout=1.0, destination=["a@test", "b@test"]).stats() or {}
    assert stats["a@test"]["prefetch_count"] == stats["b@test"]["prefetch_count"] + 3, stats
    app.close()


def _leader(sent: list[str]) -> Any:
    """A `Prefetching` leader (prefetch 2) that records what it would deliver in `sent`."""
    from types import SimpleNamespace

    from celery_ojs_ml.integration.prefetching import Prefetching

    class Leader(Prefetching):
        def __init__(self) -> None:
            # planned starts up to 15 s away count as soon (half of max_hold_s)
            self.settings = SimpleNamespace(prefetch=2, max_hold_s=30.0)
            self._prefetched = {}
            self._turnover = {}
            self._dirty = False

        def _deliver(self, task_id: str, *args: Any, **kwargs: Any) -> None:
            sent.append(task_id)

    return Leader


def _full(name: str, gpus: int = 1, each: int = 1) -> Any:
    """A worker whose every GPU is held by running spot-band jobs of `each` GPUs."""
    from celery_ojs_ml.scheduler import RunningJob
    from celery_ojs_ml.scheduler.model import WorkerState
    from celery_ojs_ml.testing.builders import worker_with

    running = [
        RunningJob(f"{name}-run{i}", "on-demand", started_at=90.0, gpus=each)
        for i in range(gpus // each)
    ]
    return WorkerState.of(name, worker_with(gpus=gpus), running)


def test_a_job_sitting_out_a_give_back_is_not_prefetched_back_at_once() -> None:
    """A reserved job in its give-back back-off keeps its reservation (and its place), but
    is not delivered ahead to the worker: the back-off exists so a job a gate disagrees
    on does not bounce back there on every pass."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation
    from celery_ojs_ml.spec.normalize import normalize

    sent: list[str] = []
    Leader = _leader(sent)

    req = normalize({"ext_ml_gpu_count": 1}).requirements
    jobs = {
        "fresh": PendingJob("fresh", req, submitted_at=1.0),
        "returned": PendingJob("returned", req, submitted_at=2.0, not_before=105.0),
    }
    decision = Decision(
        reservations=(Reservation("fresh", "w", 110.0), Reservation("returned", "w", 110.0))
    )
    records: dict[str, dict[str, Any]] = {t: {"state": "pending"} for t in jobs}
    fleet = [_full("w")]
    Leader()._prefetch(decision, fleet, records, jobs, now=100.0)
    assert sent == ["fresh"]
    sent.clear()
    Leader()._prefetch(decision, fleet, records, jobs, now=106.0)
    assert sent == ["fresh", "returned"], "sent ahead once its back-off is over"


def test_a_job_ranked_above_a_preemptible_job_on_its_worker_is_not_prefetched() -> None:
    """It may preempt there once the victim is old enough, which only a pass plans; a job
    after it in order is not sent ahead either (the gate would start it first, if the
    victim ended), and a job of the running one's band (it cannot preempt it) reserved
    there with nothing ahead of it is still sent ahead."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation, RunningJob
    from celery_ojs_ml.scheduler.model import WorkerState
    from celery_ojs_ml.spec.normalize import normalize
    from celery_ojs_ml.testing.builders import worker_with

    sent: list[str] = []
    Leader = _leader(sent)

    spot = RunningJob("victim", "spot", started_at=90.0, gpus=1, preemptible=True)
    fleet = [WorkerState.of("w", worker_with(gpus=1), [spot])]
    jobs = {
        "urgent": PendingJob("urgent", normalize({"ext_ml_gpu_count": 1,
                             "ext_ml_priority_class": "reserved"}).requirements),
        "cheap": PendingJob("cheap", normalize({"ext_ml_gpu_count": 1,
                            "ext_ml_priority_class": "spot"}).requirements),
    }  # fmt: skip
    decision = Decision(
        reservations=(Reservation("urgent", "w", 110.0), Reservation("cheap", "w", 110.0))
    )
    records: dict[str, dict[str, Any]] = {t: {"state": "pending"} for t in jobs}
    Leader()._prefetch(decision, fleet, records, jobs, now=100.0)
    assert sent == [], "a job was sent ahead of one before it in order on its worker"
    alone = Decision(reservations=(Reservation("cheap", "w", 110.0),))
    Leader()._prefetch(alone, fleet, records, jobs, now=100.0)
    assert sent == ["cheap"]


def test_once_a_reserved_job_is_not_sent_ahead_no_later_job_is_sent_to_that_worker() -> None:
    """Fleet order at the gate (docs/scheduling.md, order rule 1): a gang rank reserved on
    `w` cannot be prefetched, so the 1-GPU job after it is not sent there either (the gate
    would start it first and delay the gang); another worker's reservations still are."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation
    from celery_ojs_ml.spec.normalize import normalize

    sent: list[str] = []
    Leader = _leader(sent)
    req = normalize({"ext_ml_gpu_count": 1}).requirements
    jobs = {
        "rank0": PendingJob("rank0", req, submitted_at=1.0, gang="g", gang_size=2, rank=0),
        "small": PendingJob("small", req, submitted_at=2.0),
        "other": PendingJob("other", req, submitted_at=3.0),
    }
    decision = Decision(
        reservations=(
            Reservation("rank0", "w", 110.0),
            Reservation("small", "w", 110.0),
            Reservation("other", "v", 110.0),
        )
    )
    records: dict[str, dict[str, Any]] = {t: {"state": "pending"} for t in jobs}
    Leader()._prefetch(decision, [_full("w"), _full("v")], records, jobs, now=100.0)
    assert sent == ["other"]


def test_only_a_job_that_starts_at_the_first_end_on_a_full_worker_is_sent_ahead() -> None:
    """Held at the gate, a job that waits through several ends would keep shorter jobs off
    the GPUs freed meanwhile (the gate's backfill rule knows no time limits), and on a
    worker with a free GPU it would keep the backfill the pass allows off that GPU."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation
    from celery_ojs_ml.scheduler.model import WorkerState
    from celery_ojs_ml.spec.normalize import normalize
    from celery_ojs_ml.testing.builders import worker_with

    sent: list[str] = []
    Leader = _leader(sent)
    one = normalize({"ext_ml_gpu_count": 1}).requirements
    two = normalize({"ext_ml_gpu_count": 2}).requirements
    jobs = {"two": PendingJob("two", two, submitted_at=1.0), "one": PendingJob("one", one)}
    plan = Decision(reservations=(Reservation("two", "w", 110.0), Reservation("one", "w", 111)))
    records: dict[str, dict[str, Any]] = {t: {"state": "pending"} for t in jobs}
    Leader()._prefetch(plan, [_full("w", gpus=4, each=1)], records, jobs, now=100.0)
    assert sent == [], "a 2-GPU job sent ahead where each end frees 1 GPU (and one after it)"
    Leader()._prefetch(plan, [_full("w", gpus=4, each=2)], records, jobs, now=100.0)
    assert sent == ["two", "one"]
    sent.clear()
    half = WorkerState.of("w", worker_with(gpus=4), list(_full("w", 2).running))
    Leader()._prefetch(plan, [half], records, jobs, now=100.0)
    assert sent == [], "sent ahead to a worker with free GPUs"


def test_a_prefetched_job_is_taken_back_when_a_job_ahead_of_it_in_order_waits_for_its_worker() -> (
    None
):
    """A spot job waits at `w`'s gate; a reserved-band job published after it is reserved on
    `w`. The gate would start the spot job first, so the leader takes it back (fenced by
    its token); a prefetched job with nothing ahead of it on its worker stays."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation
    from celery_ojs_ml.spec.normalize import normalize

    req = normalize({"ext_ml_gpu_count": 1}).requirements
    taken: list[tuple[str, str, str]] = []

    class Book:
        def take_back(self, task_id: str, token: str, why: str, cool: bool = True) -> bool:
            taken.append((task_id, token, why))
            return True

    leader = _leader([])()
    leader.book = Book()  # type: ignore[attr-defined]
    leader.parse = lambda headers: req  # type: ignore[attr-defined]

    def held(band: str, at: float, worker: str) -> dict[str, Any]:
        meta = {"band": band, "submitted_at": at, "queue": "celery"}
        return {"state": "assigned", "worker": worker, "token": "t1", "meta": meta,
                "msg": {"headers": {}}}  # fmt: skip

    records = {"spot": held("spot", 1.0, "w"), "calm": held("spot", 1.5, "v")}
    leader._prefetched = {"spot": "w", "calm": "v"}
    urgent = PendingJob("urgent", req, submitted_at=5.0, band="reserved")
    later = PendingJob("later", req, submitted_at=6.0, band="spot")
    decision = Decision(
        reservations=(Reservation("urgent", "w", 110.0), Reservation("later", "v", 110.0))
    )
    leader._unhold(decision, [], records, {"urgent": urgent, "later": later})
    assert [t[0] for t in taken] == ["spot"], taken
    assert taken[0][1] == "t1" and "urgent, ahead of it in fleet order" in taken[0][2]
    assert leader._prefetched == {"calm": "v"}


def test_a_taken_back_copy_held_at_the_gate_does_not_block_the_jobs_held_behind_it(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The leader takes back prefetched jobs that do not start within the assignment
    timeout (1 s here, under the running jobs' 3 s) and delivers them again to the same
    worker, so the gate holds a stale copy ahead of the current one. When the running
    jobs end, the stale copy is started, found stale and dropped: the GPUs it was given
    are free, and the held jobs behind it must start on them, although no job runs
    there any more to release anything (found with a leader failover under prefetch:
    every later copy waited behind a stale one, and five jobs of ten never ran)."""
    app = make_app(redis_url)
    env = {"OJS_TEST_CONF": json.dumps({"ojs_ml_prefetch": 2}), "OJS_TEST_ASSIGN_TIMEOUT": "1"}
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x2", tmp_path, concurrency=4,
                           extra_env=env)  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        limit = {"ext_ml_timeout_seconds": 4}  # a planned start within max_hold_s / 2
        ids = [
            app.tasks["ml.record"].apply_async(args=[f"s{i}", 3.0], headers=limit).id
            for i in range(4)
        ]
        deadline = time.monotonic() + 30
        while redis_client.llen(RESULTS_KEY) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # nothing runs twice afterwards
    runs = [json.loads(r) for r in redis_client.lrange(RESULTS_KEY, 0, -1)]
    assert sorted(r["task_id"] for r in runs) == sorted(ids), "a job was lost or ran twice"
    log = (tmp_path / "a.log").read_text()
    assert "was assigned elsewhere since; dropping this copy" in log, "no stale copy was held"
    first_end = min(r["end"] for r in runs)
    later = sorted(r["start"] for r in runs)[2:]
    assert all(start - first_end < 2.0 for start in later), (
        f"the held jobs waited {[round(s - first_end, 2) for s in later]} s after GPUs freed"
    )
    app.close()


def test_prioritize_moves_a_prefetched_job_ahead_of_those_prefetched_before_it(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """RFC 27 prioritize of a job already delivered ahead to a gate: it is taken back
    (fenced by its token), placed again in its new order, delivered with its new
    priority, and the gate starts it before the jobs published before it."""
    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    book = PendingBook(OJSStore(redis_client, prefix="ojs"))
    env = {"OJS_TEST_CONF": json.dumps({"ojs_ml_prefetch": 3})}
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2,
                           extra_env=env)  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        blocker = record.apply_async(
            args=["blocker", 2.0], headers={"ext_ml_timeout_seconds": 4}
        ).id
        time.sleep(0.5)
        first, second, last = (record.apply_async(args=[t, 0.1]).id for t in "abc")
        deadline = time.monotonic() + 10
        while (book.get(last) or {}).get("state") != "assigned":
            assert time.monotonic() < deadline, book.get(last)
            time.sleep(0.05)
        assert app.ojs_ml.prioritize(last, 9), "an assigned job not started yet is reordered"
        deadline = time.monotonic() + 30
        while redis_client.llen(RESULTS_KEY) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
    runs = {r["task_id"]: r for r in map(json.loads, redis_client.lrange(RESULTS_KEY, 0, -1))}
    assert sorted(runs) == sorted([blocker, first, second, last]), "a job was lost or ran twice"
    assert runs[last]["start"] < runs[first]["start"] < runs[second]["start"], runs
    app.close()


def test_a_job_that_may_preempt_is_not_delivered_ahead_and_preempts_once_its_victim_is_old(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A reserved job reserved behind a running spot job is not delivered ahead: a job at a
    gate cannot be planned a preemption, so it would wait for the spot job's end. It
    waits in the pending set and preempts once the victim has run the minimum runtime."""
    app = make_app(redis_url)
    conf = json.dumps({"ojs_ml_prefetch": 2})
    env = {"OJS_TEST_CONF": conf, "OJS_TEST_MIN_RUNTIME": "2", "OJS_TEST_CKPT": str(tmp_path)}
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=3,
                           extra_env=env)  # fmt: skip
    with running([worker], OJSStore(redis_client, prefix="ojs")):
        spot = (
            app.tasks["ml.ckpt_train"]
            .apply_async(args=[30, 0.25], headers={"ext_ml_priority_class": "spot"})
            .id
        )
        deadline = time.monotonic() + 20
        while not redis_client.llen(f"ojs-test:runs:{spot}"):
            assert time.monotonic() < deadline, "the spot job never ran"
            time.sleep(0.05)
        reserved = (
            app.tasks["ml.record"]
            .apply_async(args=["reserved", 0.2], headers={"ext_ml_priority_class": "reserved"})
            .id
        )
        deadline = time.monotonic() + 20
        while redis_client.llen(RESULTS_KEY) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        deadline = time.monotonic() + 60
        while not redis_client.get(f"ojs-test:done:{spot}") and time.monotonic() < deadline:
            time.sleep(0.1)
    runs = [json.loads(r) for r in redis_client.lrange(f"ojs-test:runs:{spot}", 0, -1)]
    done = [json.loads(r) for r in redis_client.lrange(RESULTS_KEY, 0, -1)]
    assert [r["task_id"] for r in done] == [reserved], done
    assert done[0]["start"] < runs[0]["t0"] + 30 * 0.25, "it waited for the spot job's end"
    assert len(runs) == 2, "the spot job was preempted once and resumed"
    log = (tmp_path / "a.log").read_text()
    assert f"assigned {reserved} to a@test (ahead of capacity" not in log
    app.close()


def test_an_escalated_job_is_not_sent_ahead_and_the_jobs_it_now_outranks_are_taken_back() -> None:
    """OJS ML §8.4: escalation changes only the band a pass sees; the job's message keeps
    its old band, which the gate orders held jobs by. So it is not sent ahead (nor is a
    job after it, to that worker), and an on-demand job already held at that gate, which
    it now outranks, is taken back."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation
    from celery_ojs_ml.spec.normalize import normalize

    spot = normalize(
        {"ext_ml_gpu_count": 1, "ext_ml_priority_class": "spot",
         "ext_ml_priority_escalation": True, "ext_ml_escalation_target_class": "reserved"}
    ).requirements  # fmt: skip
    plain = normalize({"ext_ml_gpu_count": 1}).requirements
    sent: list[str] = []
    taken: list[str] = []

    class Book:
        def take_back(self, task_id: str, token: str, why: str, cool: bool = True) -> bool:
            taken.append(task_id)
            return True

        def annotate(self, notes: Any, ahead: bool = False) -> None:
            pass

    leader = _leader(sent)()
    leader.book = Book()  # type: ignore[attr-defined]
    leader.parse = lambda headers: plain  # type: ignore[attr-defined]
    leader._notes = {}  # type: ignore[attr-defined]
    meta = {"band": "on-demand", "submitted_at": 0.5, "queue": "celery"}
    records: dict[str, dict[str, Any]] = {
        "held": {"state": "assigned", "worker": "w", "token": "t", "meta": meta,
                 "msg": {"headers": {}}},
        "esc": {"state": "pending"},
        "next": {"state": "pending"},
    }  # fmt: skip
    leader._prefetched = {"held": "w"}
    jobs = {
        "esc": PendingJob("esc", spot, submitted_at=1.0, band="spot"),
        "next": PendingJob("next", plain, submitted_at=2.0, band="on-demand"),
    }
    decision = Decision(
        reservations=(Reservation("esc", "w", 110.0), Reservation("next", "w", 111.0)),
        escalations={"esc": "spot"},
    )
    fleet = [_full("w")]
    leader._unhold(decision, fleet, records, jobs)
    assert taken == ["held"], "the held on-demand job would start before the escalated job"
    leader._prefetch(decision, fleet, records, jobs, now=100.0)
    assert sent == [], sent


def test_a_job_goes_ahead_only_where_it_is_likely_to_start_before_the_gate_gives_it_back() -> None:
    """Jobs without time limits (no planned start) go ahead only to a worker where a pass
    saw a running job end within half of `ojs_ml_max_hold_s`; a planned start further
    away than that is not sent ahead. Elsewhere the gate would give the job back after
    `ojs_ml_max_hold_s` and it would be sent again, over and over."""
    from celery_ojs_ml.scheduler import Decision, PendingJob, Reservation
    from celery_ojs_ml.scheduler.model import WorkerState
    from celery_ojs_ml.spec.normalize import normalize
    from celery_ojs_ml.testing.builders import worker_with

    sent: list[str] = []
    leader = _leader(sent)()
    req = normalize({"ext_ml_gpu_count": 1}).requirements
    jobs = {"j": PendingJob("j", req)}
    records: dict[str, dict[str, Any]] = {"j": {"state": "pending"}}
    unknown = Decision(reservations=(Reservation("j", "w", None),))
    first = _full("w", gpus=2)
    leader._prefetch(unknown, [first], records, jobs, now=100.0)
    assert sent == [], "sent ahead with no end seen and no planned start"
    one_ended = WorkerState.of(
        "w", worker_with(gpus=2), [*first.running[1:], _full("x").running[0]]
    )
    leader._prefetch(unknown, [one_ended], records, jobs, now=101.0)
    assert sent == ["j"], "a job ended there a second ago"
    sent.clear()
    leader._prefetch(unknown, [one_ended], records, jobs, now=140.0)
    assert sent == [], "no end seen for 39 s (horizon 15 s)"
    far = Decision(reservations=(Reservation("j", "w", 160.0),))
    leader._prefetch(far, [one_ended], records, jobs, now=140.0)
    assert sent == [], "planned start 20 s away"
    near = Decision(reservations=(Reservation("j", "w", 150.0),))
    leader._prefetch(near, [one_ended], records, jobs, now=140.0)
    assert sent == ["j"]


def test_with_the_defaults_the_next_job_waits_at_the_gate_and_explain_shows_it_waiting(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """`ojs_ml_prefetch` is on by default (2): a job planned to start within
    `ojs_ml_max_hold_s / 2` on a full worker is sent to its gate ahead of time, `explain
    --json` shows it `pending` with `ahead`, its worker, a reason and an estimate, and it
    starts right after the blocker ends, without waiting for a scheduler pass."""
    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_ojs_ml.cli.main import cli

    app = make_app(redis_url)
    record = app.tasks["ml.record"]
    book = PendingBook(OJSStore(redis_client, prefix="ojs"))
    worker = WorkerProcess("a", redis_url, "profile:nvidia-a100x1", tmp_path, concurrency=2)

    def explain(task_id: str) -> dict[str, Any]:
        obj = CLIContext(app=app, no_color=True, workdir=None, quiet=False)
        args = ["explain", task_id, "--json", "--timeout", "0.5"]
        result = CliRunner().invoke(cli, args, obj=obj, catch_exceptions=False)
        return dict(json.loads(result.stdout))

    with running([worker], OJSStore(redis_client, prefix="ojs")):
        blocker = record.apply_async(args=["blocker", 2.5], headers={"ext_ml_timeout_seconds": 3})
        deadline = time.monotonic() + 20
        while (book.get(blocker.id) or {}).get("state") != "started":
            assert time.monotonic() < deadline, "the blocker never started"
            time.sleep(0.05)
        nxt = record.apply_async(args=["next", 0.1])
        seen: dict[str, Any] = {}
        deadline = time.monotonic() + 10
        while not seen.get("ahead"):
            assert time.monotonic() < deadline, f"never sent ahead: {seen}"
            seen = explain(nxt.id)
            time.sleep(0.1)
        deadline = time.monotonic() + 20
        while redis_client.llen(RESULTS_KEY) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    runs = {r["task_id"]: r for r in map(json.loads, redis_client.lrange(RESULTS_KEY, 0, -1))}
    assert sorted(runs) == sorted([blocker.id, nxt.id]), "a job was lost or ran twice"
    assert seen["state"] == "pending" and seen["worker"] == "a@test", seen
    assert "delivered ahead to a@test" in seen["reason_pending"], seen
    assert abs(seen["t_estimate"] - runs[nxt.id]["start"]) <= 2.0, (seen, runs[nxt.id])
    assert runs[nxt.id]["start"] - runs[blocker.id]["end"] < 0.5, "it waited for a pass"
    app.close()
