"""The pool child's side of dynamic batching (`child.batch`): the body gets the batch,
and each request's outcome is stored under its own id (docs/serving.md, "Dynamic
batching"). A request context with the gate's `ojs_batch` header stands for a
batch the gate formed; the result backend is Celery's in-memory cache."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_ojs_ml.checkpoint.preempt import Preempted
from celery_ojs_ml.child.batch import BatchRequest, BatchResultError, install
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.batch import batch_record

SEEN: list[list[BatchRequest]] = []


def _app() -> Celery:
    app = Celery("t", broker="memory://", backend="cache+memory://", set_as_current=False)
    install(app)

    @app.task(bind=True, name="t.double", shared=False, ml_batch={"max_size": 8})
    def double(self: Any, requests: list[BatchRequest]) -> Any:
        SEEN.append(requests)
        first = requests[0].args[0]
        if first == "raise":
            raise RuntimeError("the whole batch failed")
        if first == "preempt":
            raise Preempted(self.request.id)
        if first == "short":
            return [1]
        return [ValueError(f"no {r.args[0]}") if r.args[0] < 0 else 2 * r.args[0] for r in requests]

    app.finalize()
    return app


@pytest.fixture
def app() -> Iterator[Celery]:
    SEEN.clear()
    found = _app()
    yield found
    found.close()


def _member(task_id: str, x: Any) -> dict[str, Any]:
    return {"id": task_id, "task": "t.double", "args": [x], "kwargs": {}, "hostname": "w@h"}


def _ids() -> Iterator[str]:
    """Task ids no other test used (the in-memory result cache lives as long as the process)."""
    while True:
        yield uuid.uuid4().hex


IDS = _ids()


def _call(app: Celery, first: Any, others: dict[str, Any]) -> Any:
    """Run the task's body as a pool child runs the first request of a batch."""
    task = app.tasks["t.double"]
    members = [_member(task_id, x) for task_id, x in others.items()]
    record = {h.BATCH: batch_record(members, False)}
    task.push_request(id="first", args=[first], kwargs={}, **record)
    try:
        return task.run(first)
    finally:
        task.pop_request()


def test_the_body_gets_every_request_and_each_result_is_stored_under_its_own_id(
    app: Celery,
) -> None:
    f2, f3 = next(IDS), next(IDS)
    assert _call(app, 1, {f2: 2, f3: 3}) == 2
    assert [(r.id, r.args) for r in SEEN[0]] == [("first", (1,)), (f2, (2,)), (f3, (3,))]
    assert app.AsyncResult(f2).get(timeout=1) == 4
    assert app.AsyncResult(f3).get(timeout=1) == 6


def test_an_exception_returned_for_one_request_fails_that_request_alone(app: Celery) -> None:
    bad, good = next(IDS), next(IDS)
    assert _call(app, 1, {bad: -5, good: 3}) == 2
    assert app.AsyncResult(bad).state == "FAILURE"
    assert isinstance(app.AsyncResult(bad).result, ValueError)
    assert app.AsyncResult(good).get(timeout=1) == 6


def test_an_exception_returned_for_the_first_request_is_raised_for_it(app: Celery) -> None:
    good = next(IDS)
    with pytest.raises(ValueError, match="no -1"):
        _call(app, -1, {good: 3})
    assert app.AsyncResult(good).get(timeout=1) == 6


def test_an_exception_raised_by_the_body_fails_every_request(app: Celery) -> None:
    f2 = next(IDS)
    with pytest.raises(RuntimeError, match="the whole batch failed"):
        _call(app, "raise", {f2: 2})
    assert app.AsyncResult(f2).state == "FAILURE"
    assert "the whole batch failed" in str(app.AsyncResult(f2).result)


def test_a_result_of_the_wrong_length_fails_every_request_with_a_teaching_error(
    app: Celery,
) -> None:
    f2 = next(IDS)
    with pytest.raises(BatchResultError) as caught:
        _call(app, "short", {f2: 2})
    assert str(caught.value).startswith(
        "task t.double received 2 requests and returned a list of 1; a batched task returns "
        "a list with one result per request, in order"
    )
    assert app.AsyncResult(f2).state == "FAILURE"


def test_a_preempted_batch_stores_nothing_for_the_others(app: Celery) -> None:
    """The worker re-publishes each of them as a preempted job (`worker.batch_runs`)."""
    f2 = next(IDS)
    with pytest.raises(Preempted):
        _call(app, "preempt", {f2: 2})
    assert app.AsyncResult(f2).state == "PENDING"


def test_a_call_outside_a_batch_gets_a_list_of_one(app: Celery) -> None:
    task = app.tasks["t.double"]
    assert task(4) == 8
    assert task.apply(args=(5,)).get() == 10
    assert [len(b) for b in SEEN] == [1, 1]
    assert task.typing is False, "arguments are checked against the batch body, not a request"


def test_a_task_with_a_bad_declaration_fails_every_call_with_the_error() -> None:
    app = Celery("t", broker="memory://", set_as_current=False)
    install(app)

    @app.task(name="t.bad", shared=False, ml_batch={"max_size": 0})
    def bad(requests: list[BatchRequest]) -> list[Any]:
        return []

    app.finalize()  # Celery logs what its finalize signal raised; the task keeps the error
    with pytest.raises(ConfigError, match=r"task t\.bad: ml_batch max_size is 0"):
        app.tasks["t.bad"](1)
    app.close()


def test_a_requests_link_callback_gets_its_own_result(app: Celery) -> None:
    got: list[Any] = []

    @app.task(name="t.collect", shared=False)
    def collect(value: Any) -> None:
        got.append(value)

    app.conf.task_always_eager = True  # the callback runs here, at once
    task = app.tasks["t.double"]
    member = {**_member(next(IDS), 7), "callbacks": [collect.s()]}
    task.push_request(id="first", args=[1], kwargs={}, **{h.BATCH: batch_record([member], False)})
    try:
        task.run(1)
    finally:
        task.pop_request()
    assert got == [14]
