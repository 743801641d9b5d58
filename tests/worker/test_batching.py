"""Dynamic batching at the gate: which requests form a batch and when it goes
(`worker.batch_groups`, `worker.batching`), with a real allocator and a stand-in gate;
the `ml_batch` declaration (`wire.batch`); the one Celery internal it reads."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.mocks import TaskMessage
from celery.worker.request import Request

from celery_ojs_ml.allocator import Allocation, Allocator
from celery_ojs_ml.celery_internals import request_embed
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.testing.builders import worker_with
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.batch import BatchOptions, options_of
from celery_ojs_ml.worker.batch_groups import (
    Forming,
    FormingBook,
    goes_now,
    group_key,
    take_waiting,
)
from celery_ojs_ml.worker.batching import Batcher
from celery_ojs_ml.worker.running import Running

ONE_GPU = normalize({"ext_ml_gpu_count": 1}).requirements
BATCHED = SimpleNamespace(name="infer", ml_batch={"max_size": 3, "max_wait_ms": 5})
PLAIN = SimpleNamespace(name="train")


class Req:
    """A request as the gate sees it: a task, an id, its headers."""

    def __init__(self, rid: str, task: Any = BATCHED, cls: str = "c1", **headers: Any) -> None:
        self.id, self.task, self.name = rid, task, task.name
        self.request_dict = {h.CLASS: cls, h.BAND: "on-demand", **headers}
        self.is_revoked = False

    def revoked(self) -> bool:
        return self.is_revoked

    def __repr__(self) -> str:
        return self.id


class Timer:
    def __init__(self) -> None:
        self.entries: list[tuple[float, Callable[..., Any], tuple[Any, ...]]] = []

    def call_after(self, secs: float, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> Any:
        self.entries.append((secs, fn, args))
        return SimpleNamespace(cancel=lambda: None)

    def fire(self) -> None:
        entries, self.entries = self.entries, []
        for _, fn, args in entries:
            fn(*args)


class Gate:
    """What the batcher uses of the worker's gate: allocate or hold on arrival, dispatch,
    leave the hold, and the pump after a batch ends."""

    def __init__(self, gpus: int) -> None:
        self.allocator = Allocator(worker_with(gpus=gpus))
        self.timer = Timer()
        self.batching = Batcher(
            SimpleNamespace(timer=self.timer), self, self.allocator, Running(),
            SimpleNamespace(pending={}),
        )  # fmt: skip
        self.started: list[tuple[str, tuple[int, ...], list[str]]] = []
        self.left_hold: list[str] = []

    def arrive(self, req: Req) -> None:
        out = self.allocator.try_alloc(req, req.id, ONE_GPU)
        if isinstance(out, Allocation):
            self._dispatch(req, out)
        else:
            self.allocator.hold(out)  # type: ignore[arg-type]

    def _dispatch(self, req: Any, alloc: Allocation) -> None:
        if self.batching.takes(req, alloc):
            return
        followers = self.batching.runs.pending.pop(req, [])
        self.started.append((req.id, alloc.devices, [f.id for f in followers]))

    def end(self, head_id: str) -> None:
        """The batch ended: its allocation is free, held requests start (the gate's pump)."""
        head = next(a.key for a in self.allocator.allocations() if a.task_id == head_id)
        self.allocator.free(head)
        for alloc in self.allocator.pump():
            self.leave_hold(alloc.key)
            self._dispatch(alloc.key, alloc)

    def leave_hold(self, req: Any) -> None:
        self.left_hold.append(req.id)

    def _pump_soon(self) -> None:
        pass


# -- the groups ------------------------------------------------------------------------------


def test_requests_of_one_task_class_band_and_model_share_a_group() -> None:
    a = group_key("infer", {h.CLASS: "c1", h.BAND: "spot", "ext_ml_model_id": "m"})
    assert a == group_key("infer", {h.CLASS: "c1", h.BAND: "spot", "ext_ml_model_id": "m"})
    assert a != group_key("other", {h.CLASS: "c1", h.BAND: "spot", "ext_ml_model_id": "m"})
    assert a != group_key("infer", {h.CLASS: "c2", h.BAND: "spot", "ext_ml_model_id": "m"})
    assert a != group_key("infer", {h.CLASS: "c1", h.BAND: "reserved", "ext_ml_model_id": "m"})
    assert a != group_key("infer", {h.CLASS: "c1", h.BAND: "spot", "ext_ml_model_id": "n"})


def test_a_gang_rank_never_batches() -> None:
    assert group_key("infer", {h.CLASS: "c1", h.GANG: {"id": "g", "size": 2, "rank": 0}}) is None
    assert group_key("infer", {h.CLASS: "c1", h.RENDEZVOUS: {}}) is None


def test_a_request_without_a_class_header_is_grouped_by_its_ml_headers() -> None:
    one = group_key("infer", {"ext_ml_gpu_count": 1})
    assert one == group_key("infer", {"ext_ml_gpu_count": 1, "unrelated": 3})
    assert one != group_key("infer", {"ext_ml_gpu_count": 2})


def test_waiting_requests_join_in_hold_order_up_to_the_room_left() -> None:
    held = ["a1", "b1", "a2", "a3", "a4"]
    key_of: Callable[[Any], Any] = lambda r: ("k", r[0])  # noqa: E731
    assert take_waiting(held, ("k", "a"), key_of, 2) == ["a1", "a2"]
    assert take_waiting(held, ("k", "a"), key_of, 0) == []
    assert take_waiting(held, ("k", "b"), key_of, 5) == ["b1"]


def test_a_batch_goes_at_once_when_full_when_requests_waited_or_when_it_may_not_wait() -> None:
    batch = Forming(("k",), "head", None, max_size=3, deadline=10.0)
    assert not goes_now(batch, found_waiting=False, now=9.0)
    assert goes_now(batch, found_waiting=True, now=9.0)
    assert goes_now(batch, found_waiting=False, now=10.0)
    batch.followers += ["f1", "f2"]
    assert batch.full and batch.room == 0 and goes_now(batch, found_waiting=False, now=9.0)


def test_the_book_offers_only_a_batch_with_room() -> None:
    book = FormingBook()
    batch = Forming(("k",), "head", None, max_size=2, deadline=1.0)
    book.add(batch)
    assert book.joinable(("k",)) is batch and book.joinable(("other",)) is None
    batch.followers.append("f")
    assert book.joinable(("k",)) is None
    assert book.due(0.5) == [] and book.due(1.0) == [batch]


# -- forming at the gate -----------------------------------------------------------------------


def test_a_request_alone_on_an_idle_device_waits_its_max_wait_then_goes_alone() -> None:
    gate = Gate(gpus=1)
    gate.arrive(Req("r1"))
    assert gate.started == [] and [e[0] for e in gate.timer.entries] == [0.005]
    gate.timer.fire()
    assert gate.started == [("r1", (0,), [])]


def test_requests_that_get_devices_while_a_batch_forms_join_it_and_it_goes_when_full() -> None:
    gate = Gate(gpus=4)
    for rid in ("r1", "r2", "r3", "r4"):
        gate.arrive(Req(rid))
    assert gate.started[0][0] == "r1" and gate.started[0][2] == ["r2", "r3"]
    assert [a.task_id for a in gate.allocator.allocations()] == ["r1", "r4"], (
        "a joining request kept an allocation: a batch runs on one device set"
    )
    gate.timer.fire()
    assert gate.started[1][0] == "r4" and gate.started[1][2] == []


def test_requests_held_behind_a_running_batch_go_at_once_as_the_next_batch() -> None:
    gate = Gate(gpus=1)
    gate.arrive(Req("r1"))
    gate.timer.fire()
    for i in range(2, 7):
        gate.arrive(Req(f"r{i}"))
    assert len(gate.allocator.held()) == 5
    gate.end("r1")
    assert gate.started[1] == ("r2", (0,), ["r3", "r4"]), "max_size is 3"
    assert gate.left_hold == ["r2", "r3", "r4"] and gate.timer.entries == []
    gate.end("r2")
    assert gate.started[2] == ("r5", (0,), ["r6"])


def test_requests_of_another_task_or_class_never_join_a_batch() -> None:
    gate = Gate(gpus=4)
    gate.arrive(Req("r1"))
    gate.arrive(Req("plain", task=PLAIN))
    gate.arrive(Req("other-class", cls="c2"))
    assert gate.started == [("plain", (1,), [])]
    gate.timer.fire()
    assert sorted(s[0] for s in gate.started) == ["other-class", "plain", "r1"]
    assert all(followers == [] for _, _, followers in gate.started)


def test_a_held_request_of_another_group_stays_held_when_a_batch_goes() -> None:
    gate = Gate(gpus=1)
    gate.arrive(Req("r1"))
    gate.timer.fire()
    gate.arrive(Req("other", cls="c2"))
    gate.arrive(Req("r2"))
    gate.end("r1")  # `other` was first in the hold queue: it forms, alone
    gate.timer.fire()
    assert gate.started[1] == ("other", (0,), [])
    assert [p.task_id for p in gate.allocator.held()] == ["r2"]


def test_a_revoked_head_leaves_its_followers_to_the_gate() -> None:
    gate = Gate(gpus=1)
    again: list[str] = []
    gate.batching.again = lambda reqs: again.extend(r.id for r in reqs)  # type: ignore[method-assign]
    head = Req("r1")
    gate.arrive(head)
    gate.timer.fire()
    gate.end("r1")  # nothing held: the device is free
    gate.arrive(head := Req("r2"))
    gate.arrive(Req("r3"))  # held: r2 forms on the only GPU
    head.is_revoked = True
    gate.timer.fire()
    assert again == ["r3"] and gate.allocator.allocations() == []


def test_a_forming_batch_gives_its_allocation_back_when_the_consumer_stops() -> None:
    gate = Gate(gpus=1)
    gate.arrive(Req("r1"))
    gate.batching.close()
    assert gate.allocator.allocations() == [] and len(gate.batching.book) == 0


# -- the declaration ---------------------------------------------------------------------------


def test_a_declaration_gives_its_size_and_wait_in_seconds() -> None:
    task = SimpleNamespace(name="t", ml_batch={"max_size": 32, "max_wait_ms": 5})
    assert options_of(task) == BatchOptions(32, 0.005)
    assert options_of(SimpleNamespace(name="t", ml_batch={"max_size": 4})) == BatchOptions(4, 0.005)
    assert options_of(SimpleNamespace(name="t")) is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (32, "ml_batch=32; use a mapping with the keys max_size and max_wait_ms"),
        ({"max_size": 32, "wait": 5}, "use a mapping with the keys max_size and max_wait_ms"),
        ({"max_size": 0}, "ml_batch max_size is 0; use an int from 1 to 1024"),
        ({"max_size": True}, "ml_batch max_size is True; use an int from 1 to 1024"),
        ({"max_size": 8, "max_wait_ms": -1}, "ml_batch max_wait_ms is -1; use a number"),
    ],
)
def test_a_bad_declaration_is_an_error_naming_the_task_the_option_and_a_fix(
    raw: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        options_of(SimpleNamespace(name="proj.embed", ml_batch=raw))
    assert str(caught.value).startswith("task proj.embed: ")
    assert message in str(caught.value)
    assert 'e.g. ml_batch={"max_size": 32, "max_wait_ms": 5}' in str(caught.value)


# -- the Celery internal it reads --------------------------------------------------------------


def test_a_requests_embedded_callbacks_are_read_from_its_payload() -> None:
    """celery 5.7.0 `Request._payload`: this fails when that changes."""
    app = Celery("t", broker="memory://", set_as_current=False)

    @app.task(name="t.add", shared=False)
    def add(x: int) -> int:
        return x

    link = {"task": "t.add", "args": [], "kwargs": {}, "options": {}}
    message = TaskMessage("t.add", id="abc", args=(1,), kwargs={}, callbacks=[link])
    req = Request(message, app=app, task=app.tasks["t.add"])
    assert request_embed(req)["callbacks"] == [link]
    assert request_embed(object()) == {}
