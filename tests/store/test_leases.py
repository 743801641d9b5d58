"""LeaseBook on a real Redis (DESIGN decision 4), through Lua and through the fallback.

The fallback (MULTI pipeline and WATCH compare-and-set) is what runs on servers
without scripting, such as fakeredis in the embedded demo.
"""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest
import redis

from celery_ojs_ml.store.leases import LeaseBook, LeaseWriter
from celery_ojs_ml.store.registry import OJSStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["lua", "multi"])
def book(request: pytest.FixtureRequest, redis_client: redis.Redis) -> tuple[LeaseBook, Clock]:
    clock = Clock()
    leases = LeaseBook(OJSStore(redis_client, prefix="lt", clock=clock), ttl_s=30)
    if request.param == "multi":
        leases._scripts = None
    return leases, clock


def _record(task_id: str = "job-1", worker: str = "a@x") -> dict[str, Any]:
    return {"task_id": task_id, "worker": worker, "incarnation": "i1", "devices": [0]}


def test_take_writes_the_lease_and_its_deadline(book: tuple[LeaseBook, Clock]) -> None:
    leases, clock = book
    token = leases.take(_record())
    lease = leases.get("job-1")
    assert lease is not None and lease["token"] == token and lease["deadline"] == 1030.0
    assert leases.expired() == []
    clock.now = 1031.0
    assert leases.expired() == ["job-1"]


def test_release_deletes_only_a_lease_that_is_still_ours(book: tuple[LeaseBook, Clock]) -> None:
    leases, _ = book
    old = leases.take(_record())
    new = leases.take(_record(worker="b@x"))  # re-published and started elsewhere
    assert leases.release("job-1", old) is False
    assert leases.get("job-1") is not None and leases.get("job-1")["token"] == new  # type: ignore[index]
    assert leases.release("job-1", new) is True
    assert leases.get("job-1") is None and leases.all() == []
    assert leases.release("job-1", new) is False


def test_an_expired_lease_is_claimed_by_exactly_one_worker(book: tuple[LeaseBook, Clock]) -> None:
    leases, clock = book
    leases.take(_record())
    clock.now = 1100.0
    first = leases.claim("job-1", "b@x", "i2")
    second = leases.claim("job-1", "c@x", "i3")
    assert first is not None and first["worker"] == "a@x"
    assert second is None


def test_without_scripting_the_book_falls_back_by_itself() -> None:
    client = fakeredis.FakeRedis()
    leases = LeaseBook(OJSStore(client, prefix="lt"), ttl_s=30)
    token = leases.take(_record())
    assert leases._scripts is None, "fakeredis has no Lua here: the fallback ran"
    assert leases.get("job-1") is not None
    assert leases.release("job-1", token) is True
    assert leases.get("job-1") is None


class Loop:
    """Stands in for the worker's event loop: deferred calls run when told to."""

    def __init__(self) -> None:
        self.queued: list[tuple[float, Any]] = []
        self.delays: list[float] = []
        self.now = 100.0

    def clock(self) -> float:
        return self.now

    def defer(self, fn: Any, delay_s: float) -> None:
        self.queued.append((self.now + delay_s, fn))
        self.delays.append(delay_s)

    def turn(self) -> None:
        """Let time pass until every deferred call (and any it defers) has run, in due order."""
        while self.queued:
            self.step()

    def step(self) -> None:
        """Let time pass until the first deferred call is due, and run it."""
        self.queued.sort(key=lambda q: q[0])
        due, fn = self.queued.pop(0)
        self.now = max(self.now, due)
        fn()


def _commands(client: redis.Redis, name: str) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))


def test_writer_batches_takes_and_releases_of_a_loop_turn_into_one_call(
    book: tuple[LeaseBook, Clock], redis_client: redis.Redis
) -> None:
    """DESIGN decision 4: the lease is written before the ack, and batched under a loop."""
    leases, _ = book
    lua = leases._scripts is not None
    loop = Loop()
    writer = LeaseWriter(leases, loop.defer, clock=loop.clock)
    acks: list[tuple[str, bool]] = []
    old = leases.take(_record("done-1"))
    writer_old = {"done-1": old}
    warm = writer.take("warm", _record("warm"), lambda ok: None)  # the writer is busy now
    loop.turn()
    writer.release("warm", warm)
    loop.turn()
    leases.write_batch([], [])  # the script is loaded now, not inside the measured batch
    calls_before = _commands(redis_client, "evalsha") + _commands(redis_client, "exec")
    tokens = {
        f"job-{i}": writer.take(
            f"job-{i}", _record(f"job-{i}"), lambda ok, i=i: acks.append((f"job-{i}", ok))
        )
        for i in range(3)
    }
    writer.release("done-1", writer_old["done-1"])
    assert acks == [] and writer.pending() == 4 and len(loop.queued) == 1
    assert leases.get("job-0") is None, "nothing is written before the loop turns"
    loop.turn()
    assert sorted(acks) == [("job-0", True), ("job-1", True), ("job-2", True)]
    # One Lua call for the batch; without Lua, one MULTI/EXEC for the takes and a
    # compare-and-set for the release.
    calls = _commands(redis_client, "evalsha") + _commands(redis_client, "exec")
    assert calls - calls_before == (1 if lua else 2)
    for task_id, token in tokens.items():
        lease = leases.get(task_id)
        assert lease is not None and lease["token"] == token
    assert leases.get("done-1") is None
    assert writer.pending() == 0


def test_a_job_that_ends_before_its_lease_is_written_needs_no_lease(
    book: tuple[LeaseBook, Clock],
) -> None:
    leases, _ = book
    loop = Loop()
    writer = LeaseWriter(leases, loop.defer, clock=loop.clock)
    acks: list[bool] = []
    token = writer.take("quick", _record("quick"), acks.append)
    writer.release("quick", token)
    assert acks == [True], "its message is acked at once: the job is over"
    loop.turn()
    assert leases.get("quick") is None and leases.all() == []


def test_release_of_an_old_run_never_deletes_the_new_runs_queued_lease(
    book: tuple[LeaseBook, Clock],
) -> None:
    """A preempted job re-published and started again here in the same loop turn."""
    leases, _ = book
    loop = Loop()
    writer = LeaseWriter(leases, loop.defer, clock=loop.clock)
    old = leases.take(_record("again"))
    new = writer.take("again", _record("again"), lambda ok: None)
    writer.release("again", old)
    loop.turn()
    lease = leases.get("again")
    assert lease is not None and lease["token"] == new


def test_when_the_store_fails_the_writer_reports_the_take_unwritten() -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    leases = LeaseBook(OJSStore(dead, prefix="lt"), ttl_s=30)  # the store is unreachable
    loop = Loop()
    writer = LeaseWriter(leases, loop.defer, clock=loop.clock)
    acks: list[bool] = []
    writer.take("lost-store", _record("lost-store"), acks.append)
    loop.turn()
    assert acks == [False], "the broker message must keep holding the job"


def test_without_a_loop_the_writer_writes_at_once(book: tuple[LeaseBook, Clock]) -> None:
    leases, _ = book
    writer = LeaseWriter(leases, None)
    acks: list[bool] = []
    token = writer.take("sync", _record("sync"), acks.append)
    assert acks == [True] and leases.get("sync") is not None
    writer.release("sync", token)
    assert leases.get("sync") is None and writer.pending() == 0


def test_a_record_that_is_not_json_leaves_the_job_to_its_broker_message(
    book: tuple[LeaseBook, Clock],
) -> None:
    """DESIGN decision 4: no lease, no ack; the other takes of the batch are written."""
    leases, _ = book
    loop = Loop()
    writer = LeaseWriter(leases, loop.defer, clock=loop.clock)
    acks: list[tuple[str, bool]] = []
    writer.take("bad", {**_record("bad"), "args": [object()]}, lambda ok: acks.append(("bad", ok)))
    writer.take("good", _record("good"), lambda ok: acks.append(("good", ok)))
    loop.turn()
    assert sorted(acks) == [("bad", False), ("good", True)]
    assert leases.get("bad") is None and leases.get("good") is not None
    assert writer.pending() == 0
    sync: list[bool] = []
    LeaseWriter(leases, None).take("bad2", {**_record("bad2"), "args": [object()]}, sync.append)
    assert sync == [False] and leases.get("bad2") is None


def test_a_record_function_runs_only_when_the_lease_is_written(
    book: tuple[LeaseBook, Clock],
) -> None:
    leases, _ = book
    loop = Loop()
    writer = LeaseWriter(leases, loop.defer, clock=loop.clock)
    built: list[str] = []

    def record(task_id: str) -> Any:
        return lambda: built.append(task_id) or _record(task_id)

    quick = writer.take("quick", record("quick"), lambda ok: None)
    writer.take("slow", record("slow"), lambda ok: None)
    writer.release("quick", quick)  # ended before the flush
    loop.turn()
    assert built == ["slow"]
    lease = leases.get("slow")
    assert lease is not None and lease["task_id"] == "slow" and leases.get("quick") is None


def test_a_lease_is_written_once_its_job_ran_for_the_delay_idle_2_ms_busy_20_ms(
    book: tuple[LeaseBook, Clock],
) -> None:
    """DESIGN decision 4, batched: idle workers write 2 ms after dispatch; busy ones
    (a take in the last 50 ms) 20 ms after, so short jobs never cost a write."""
    from celery_ojs_ml.store import leases as module

    leases, _ = book
    loop = Loop()
    writer = LeaseWriter(leases, loop.defer, clock=loop.clock)
    acks: list[str] = []
    writer.take("a", _record("a"), lambda ok: acks.append("a"))  # idle: due in 2 ms
    loop.now += 0.001
    quick = writer.take("q", _record("q"), lambda ok: acks.append("q"))  # busy: due in 20 ms
    loop.now += 0.001
    writer.take("b", _record("b"), lambda ok: acks.append("b"))  # busy: due in 20 ms
    assert loop.delays == [pytest.approx(module.IDLE_DELAY_S)], "one timer, for the first due"
    loop.step()  # 2 ms after "a": only "a" is due
    assert acks == ["a"] and leases.get("a") is not None and leases.get("b") is None
    assert loop.delays[-1] == pytest.approx(module.BUSY_DELAY_S - 0.001), "set for 'q'"
    loop.now += 0.005
    writer.release("q", quick)  # "q" ended after 6 ms: no write for it at all
    assert acks == ["a", "q"]
    loop.turn()  # 21 ms after "q": "b" is due now
    assert acks == ["a", "q", "b"] and leases.get("b") is not None and leases.get("q") is None
    assert writer.pending() == 0
    loop.now += module.BUSY_WINDOW_S  # quiet for 50 ms: idle again
    writer.take("c", _record("c"), lambda ok: None)
    assert loop.delays[-1] == pytest.approx(module.IDLE_DELAY_S)
    strict_loop = Loop()
    strict = LeaseWriter(leases, strict_loop.defer, busy_delay_s=0.0, clock=strict_loop.clock)
    strict.take("d", _record("d"), lambda ok: None)
    strict_loop.turn()
    strict.take("e", _record("e"), lambda ok: None)
    assert strict_loop.delays == [0.0, 0.0], "lease_write_delay_ms=0: the next loop turn"


def test_a_release_on_an_idle_worker_goes_out_within_2_ms(book: tuple[LeaseBook, Clock]) -> None:
    """A finished job's lease must not linger: a claimer would re-publish a done job."""
    from celery_ojs_ml.store import leases as module

    leases, _ = book
    loop = Loop()
    writer = LeaseWriter(leases, loop.defer, clock=loop.clock)
    token = writer.take("long", _record("long"), lambda ok: None)
    loop.turn()
    assert leases.get("long") is not None
    loop.now += 3600  # a long job
    writer.release("long", token)
    assert loop.delays[-1] == pytest.approx(module.IDLE_DELAY_S)
    loop.turn()
    assert leases.get("long") is None


def test_tokens_are_unique_across_writers(book: tuple[LeaseBook, Clock]) -> None:
    leases, _ = book
    one, two = LeaseWriter(leases, Loop().defer), LeaseWriter(leases, Loop().defer)
    tokens = {
        w.take(f"t{i}", _record(f"t{i}"), lambda ok: None) for w in (one, two) for i in range(50)
    }
    assert len(tokens) == 100


def test_writer_on_fakeredis_without_lua_falls_back_by_itself() -> None:
    leases = LeaseBook(OJSStore(fakeredis.FakeRedis(), prefix="lt"), ttl_s=30)
    loop = Loop()
    writer = LeaseWriter(leases, loop.defer, clock=loop.clock)
    acks: list[bool] = []
    old = leases.take(_record("f-1"))
    token = writer.take("f-2", _record("f-2"), acks.append)
    writer.release("f-1", old)
    loop.turn()
    assert acks == [True]
    assert leases.get("f-1") is None
    lease = leases.get("f-2")
    assert lease is not None and lease["token"] == token


class ReadingLoop(Loop):
    """A loop that also watches readers, like the worker's kombu hub."""

    def __init__(self) -> None:
        super().__init__()
        self.readers: dict[int, Any] = {}

    def add_reader(self, fd: int, callback: Any) -> None:
        self.readers[fd] = callback

    def remove_reader(self, fd: int) -> None:
        self.readers.pop(fd, None)

    def poll(self, timeout: float = 5.0) -> None:
        """Call the readers whose socket is readable (waits up to `timeout`)."""
        import select

        ready, _, _ = select.select(list(self.readers), [], [], timeout)
        for fd in ready:
            self.readers[fd]()


def _async_writer(redis_client: redis.Redis) -> tuple[LeaseBook, ReadingLoop, LeaseWriter]:
    leases = LeaseBook(OJSStore(redis_client, prefix="lt"), ttl_s=30)
    loop = ReadingLoop()
    return leases, loop, LeaseWriter(leases, loop.defer, loop, clock=loop.clock)


def test_the_event_loop_reads_the_batch_reply_instead_of_waiting_for_it(
    redis_client: redis.Redis,
) -> None:
    leases, loop, writer = _async_writer(redis_client)
    acks: list[bool] = []
    token = writer.take("async-1", _record("async-1"), acks.append)
    loop.turn()  # the flush sends the batch and returns at once
    assert acks == [] and writer.pending() == 1 and len(loop.readers) == 1
    loop.poll()  # the reply arrives; the loop's reader settles the batch
    assert acks == [True] and writer.pending() == 0
    lease = leases.get("async-1")
    assert lease is not None and lease["token"] == token
    writer.release("async-1", token)
    writer.flush(wait=True)  # the heartbeat and stop wait for replies
    assert leases.get("async-1") is None and writer.pending() == 0
    writer.close()
    assert loop.readers == {}


def test_a_batch_whose_connection_breaks_is_written_again(redis_client: redis.Redis) -> None:
    leases, loop, writer = _async_writer(redis_client)
    acks: list[bool] = []
    writer.take("warm", _record("warm"), acks.append)
    writer.flush(wait=True)
    host, port = writer._conn._sock.getsockname()[:2]
    killed = redis_client.client_kill(f"{host}:{port}")  # the writer's own connection
    assert killed
    token = writer.take("after-kill", _record("after-kill"), acks.append)
    writer.flush()  # sent on the dead connection (or refused at once)
    loop.poll(timeout=1)
    writer.flush(wait=True)
    assert acks == [True, True], "the batch was written again"
    lease = leases.get("after-kill")
    assert lease is not None and lease["token"] == token
    assert writer._conn is None or writer._conn._sock.getsockname()[1] != port
    writer.close()


def test_a_batch_the_server_cannot_run_is_written_again(redis_client: redis.Redis) -> None:
    leases, loop, writer = _async_writer(redis_client)
    acks: list[bool] = []
    writer.take("before", _record("before"), acks.append)
    writer.flush(wait=True)
    redis_client.script_flush()  # as after a server restart: EVALSHA answers NOSCRIPT
    token = writer.take("noscript", _record("noscript"), acks.append)
    writer.flush()
    loop.poll()
    assert acks == [True, True]
    lease = leases.get("noscript")
    assert lease is not None and lease["token"] == token
    writer.close()


def test_pack_command_sends_what_redis_py_would() -> None:
    from redis._parsers.encoders import Encoder
    from redis.connection import PythonRespSerializer

    from celery_ojs_ml.store.leases import pack_command

    args = (
        "EVALSHA",
        "f00",
        2,
        "lt:{ml}:leases",
        "lt:{ml}:lease:é",
        1,
        '{"a": [1.5]}',
        1e9 + 0.125,
    )
    serializer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    assert pack_command(*args) == b"".join(serializer.pack(*args))


def test_fired_writes_are_sent_without_waiting_and_settled_by_the_loop(
    redis_client: redis.Redis,
) -> None:
    """The worker's wake-up advertisement (`LeaseWriter.fire`): sent on the writer's own
    connection, its replies read by the event loop, in order with lease batches."""
    _leases, loop, writer = _async_writer(redis_client)
    redone: list[str] = []
    acks: list[bool] = []
    writer.take("fired-1", _record("fired-1"), acks.append)
    writer.flush()
    commands = [("SET", "lt-fired", "1"), ("LPUSH", "lt-fired-list", "wake")]
    assert writer.fire(commands, lambda: redone.append("again")) is True
    assert writer.pending() == 2, "the lease batch and the fired writes await their replies"
    loop.poll()
    writer.flush(wait=True)
    assert writer.pending() == 0 and acks == [True] and redone == []
    assert redis_client.get("lt-fired") == b"1"
    assert redis_client.lrange("lt-fired-list", 0, -1) == [b"wake"]
    writer.close()


def test_a_fired_write_that_fails_or_whose_connection_breaks_is_redone(
    redis_client: redis.Redis,
) -> None:
    _leases, loop, writer = _async_writer(redis_client)
    redone: list[str] = []
    redis_client.set("lt-text", "not a list")
    wrong = [("LPUSH", "lt-text", "x"), ("SET", "lt-after", "1")]
    assert writer.fire(wrong, lambda: redone.append("type")) is True
    loop.poll()
    writer.flush(wait=True)
    assert redone == ["type"] and writer.pending() == 0
    assert redis_client.get("lt-after") == b"1", "every reply was read: the stream stays aligned"
    host, port = writer._conn._sock.getsockname()[:2]
    assert redis_client.client_kill(f"{host}:{port}")
    sent = writer.fire([("SET", "lt-lost", "1")], lambda: redone.append("lost"))
    loop.poll(timeout=1)
    writer.flush(wait=True)
    if sent:  # on the dead connection: its reply never came, so it is redone
        assert redone == ["type", "lost"]
    else:  # refused at once: nothing to redo, the caller writes it itself
        assert redone == ["type"]
    assert redis_client.get("lt-lost") is None, "the killed connection applied nothing"
    writer.close()


def test_without_a_loop_nothing_is_fired(book: tuple[LeaseBook, Clock]) -> None:
    leases, _ = book
    assert LeaseWriter(leases, None).fire([("SET", "x", "1")], lambda: None) is False


def test_a_new_run_of_a_job_starts_only_once_the_last_runs_lease_is_gone(
    book: tuple[LeaseBook, Clock],
) -> None:
    """A retry started here within the lease delay of the last run's end: the last run's
    queued release is written before the new run's take returns, so the new run's first
    checkpoint commit (fenced on the lease: absent or its own) does not find the old
    lease and stop as if another worker had taken the job over."""
    leases, _ = book
    loop = Loop()
    writer = LeaseWriter(leases, loop.defer, clock=loop.clock)
    old = writer.take("retried", _record("retried"), lambda ok: None)
    loop.turn()  # the first run's lease is written
    assert (leases.get("retried") or {}).get("token") == old
    writer.release("retried", old)  # it ended: its release waits for the next batch
    assert leases.get("retried") is not None, "queued, not written yet"
    new = writer.take("retried", _record("retried"), lambda ok: None)
    assert leases.get("retried") is None, "the old run's lease is gone before the new run"
    loop.turn()
    assert (leases.get("retried") or {}).get("token") == new


def test_a_copy_re_published_by_a_claimer_is_marked_by_its_own_token_only(
    book: tuple[LeaseBook, Clock],
) -> None:
    """DESIGN invariant 5: the claimer deletes the lease once it re-published the job; the
    mark tells a copy that stalled past the TTL from one whose lease the store lost."""
    leases, clock = book
    old = leases.take(_record())
    clock.now += 60
    claimed = leases.claim("job-1", "b@x", "i2")
    assert claimed is not None and claimed["token"] == old
    leases.mark_taken_back("job-1", claimed["token"])
    leases.release("job-1", claimed["claim_token"])
    assert leases.get("job-1") is None
    assert leases.was_taken_back("job-1", old), "the stalled copy's token"
    assert not leases.was_taken_back("job-1", claimed["claim_token"]), "not any other copy's"
    assert not leases.was_taken_back("job-2", old)
