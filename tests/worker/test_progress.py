"""`progress(self, step, total, **metrics)` (child/progress.py) and its record (wire/progress.py):
argument checks, the stored `PROGRESS` state, the rate estimate, checkpoint saves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kombu
import pytest
from celery import Celery

from celery_ojs_ml import OJSML, checkpoint, progress
from celery_ojs_ml.child import progress as child_progress
from celery_ojs_ml.cli.progress import describe
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire import progress as wire


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("progress", broker="memory://", backend="cache+memory://", set_as_current=False)
    yield app
    app.close()


def _run(app: Celery, *calls: tuple[Any, ...]) -> list[Any]:
    """Run a bound task eagerly that reports `calls` and reads its state after each."""
    seen: list[Any] = []

    @app.task(bind=True, name="t.report", shared=False)
    def report(self: Any) -> None:
        for args in calls:
            progress(self, *args[:2], **(args[2] if len(args) > 2 else {}))
            result = self.AsyncResult(self.request.id)
            seen.append((result.state, result.info))

    outcome = report.apply()
    if outcome.failed():
        raise outcome.result
    return seen


def test_a_report_is_stored_as_the_progress_state_with_step_total_metrics_and_eta(
    app: Celery,
) -> None:
    [(state, info)] = _run(app, (3, 10, {"loss": 0.25, "phase": "warmup", "tokens": 1024}))
    assert state == "PROGRESS"
    assert info == {
        "step": 3,
        "total": 10,
        "metrics": {"loss": 0.25, "phase": "warmup", "tokens": 1024},
        "eta_s": None,  # one report: no rate yet
    }


def test_the_eta_appears_from_the_second_report_and_is_none_without_a_total(app: Celery) -> None:
    seen = _run(app, (0, 1000), (500, 1000), (600, None))
    assert seen[0][1]["eta_s"] is None
    assert isinstance(seen[1][1]["eta_s"], float) and seen[1][1]["eta_s"] >= 0
    assert seen[2][1]["eta_s"] is None and seen[2][1]["total"] is None


@pytest.mark.parametrize(
    ("step", "total", "metrics", "error", "message"),
    [
        (-1, None, {}, ValueError, "step is -1; pass a non-negative int"),
        ("3", None, {}, TypeError, "step is '3' (str); pass a non-negative int"),
        (True, None, {}, TypeError, "step is True (bool)"),
        (2.5, 10, {}, TypeError, "step is 2.5 (float)"),
        (10, 5, {}, ValueError, "total is 5, less than step 10"),
        (1, "10", {}, TypeError, "total is '10' (str); pass the number of steps as an int"),
        (1, 10, {"loss": [1, 2]}, TypeError, "metrics['loss'] is [1, 2] (list)"),
        (1, 10, {"loss": float("nan")}, TypeError, "metrics['loss'] is nan (float)"),
        (1, 10, {"ok": None}, TypeError, "metrics['ok'] is None (NoneType)"),
        (1, 10, {"done": True}, TypeError, "metrics['done'] is True (bool)"),
    ],
    ids=lambda v: repr(v)[:20],
)
def test_bad_arguments_raise_naming_the_argument_and_store_nothing(
    app: Celery, step: Any, total: Any, metrics: dict[str, Any], error: type, message: str
) -> None:
    with pytest.raises(error) as caught:
        _run(app, (step, total, metrics))
    assert message in str(caught.value) and "e.g. progress(self, 10, 100" in str(caught.value)


def test_progress_outside_a_running_bound_task_says_how_to_call_it() -> None:
    with pytest.raises(ConfigError, match=r"bind=True .* progress\(self, 10, 100"):
        progress(SimpleNamespace(request=SimpleNamespace(id=None)), 1, 10)


def test_the_estimate_is_the_rate_since_the_runs_first_report() -> None:
    request = SimpleNamespace()
    assert wire.advance(request, 100, 1000, {}, now=10.0)["eta_s"] is None
    assert wire.advance(request, 200, 1000, {}, now=20.0)["eta_s"] == 80.0  # 800 at 10/s
    assert wire.advance(request, 300, 1000, {}, now=40.0)["eta_s"] == 105.0  # 700 at 6.67/s
    assert wire.advance(request, 1000, 1000, {}, now=41.0)["eta_s"] == 0.0


def test_a_step_backwards_starts_a_new_baseline() -> None:
    request = SimpleNamespace()
    wire.advance(request, 0, 100, {}, now=0.0)
    wire.advance(request, 50, 100, {}, now=50.0)
    assert wire.advance(request, 10, 100, {}, now=60.0)["eta_s"] is None  # a restarted loop
    assert wire.advance(request, 20, 100, {}, now=70.0)["eta_s"] == 80.0


def test_a_checkpoint_save_reports_its_step_and_numbers_unless_the_task_reports_itself() -> None:
    request = SimpleNamespace()
    fields = {"step": 7, "loss": 0.5, "metrics": {"accuracy": 0.9, "note": "ok", "bad": [1]}}
    meta = wire.from_checkpoint(request, fields, now=1.0)
    assert meta == {
        "step": 7,
        "total": None,
        "metrics": {"loss": 0.5, "accuracy": 0.9, "note": "ok"},
        "eta_s": None,
    }
    assert wire.from_checkpoint(request, {"step": None, "loss": 0.5}, now=2.0) is None
    wire.advance(request, 300, 1000, {}, now=3.0)  # the task's own report: batches
    assert wire.from_checkpoint(request, {"step": 8}, now=4.0) is None, "epochs do not clobber it"


def test_the_cli_describes_a_report_in_one_line() -> None:
    report = {"step": 40, "total": 100, "metrics": {"loss": 0.312345, "phase": "train"}}
    assert describe({**report, "eta_s": 12.4}) == (
        "step 40/100 (40%), eta 12 s, loss=0.3123 phase=train"
    )
    assert describe({"step": 5, "total": None, "metrics": {}, "eta_s": None}) == "step 5"


def test_a_checkpoint_save_with_a_step_is_stored_as_progress_unless_turned_off(
    store: OJSStore, tmp_path: Path
) -> None:
    app = Celery("ckpt", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.ojs_ml_checkpoint_prefixes = [f"file://{tmp_path}/"]
    OJSML(app)
    app.ojs_ml.use_store(store)
    ml = {"ext_ml_checkpoint_enabled": True, "ext_ml_checkpoint_storage_uri": f"file://{tmp_path}/"}
    seen: list[Any] = []

    @app.task(bind=True, name="t.train", shared=False, ml=ml)
    def train(self: Any, report: bool) -> None:
        ckpt = checkpoint(self, report_progress=report)
        ckpt.save(epoch=2, step=2, loss=0.5, metrics={"accuracy": 0.8}, files={"w": b"x"})
        result = self.AsyncResult(self.request.id)
        seen.append((result.state, result.info))

    assert not train.apply(args=[True]).failed() and not train.apply(args=[False]).failed()
    metrics = {"loss": 0.5, "accuracy": 0.8}
    assert seen[0] == ("PROGRESS", {"step": 2, "total": None, "metrics": metrics, "eta_s": None})
    assert seen[1][0] == "PENDING", "report_progress=False stores nothing"
    app.close()


def _events_of(app: Celery, run: Any) -> list[dict[str, Any]]:
    """The `ojs-progress` events sent while `run()` runs (a queue on the `celeryev` exchange)."""
    child_progress._EVENTS.clear()  # what a pool child last read of its worker's switch
    with app.connection_for_write() as conn:
        exchange = kombu.Exchange("celeryev", type="topic")  # type: ignore[attr-defined]
        queue = kombu.Queue("progress-events", exchange, routing_key="#", channel=conn)  # type: ignore[attr-defined]
        queue.declare()
        run()
        found = []
        while (message := queue.get(no_ack=True)) is not None:
            found.append(message.payload)
        queue.delete()
    return [e for e in found if e["type"] == "ojs-progress"]


@pytest.mark.parametrize(
    ("setting", "advertised", "sent"),
    [(True, False, True), (False, True, True), (False, False, False)],
    ids=["worker_send_task_events", "the worker advertises task events", "events off"],
)
def test_the_progress_event_goes_out_only_when_the_worker_sends_task_events(
    store: OJSStore, setting: bool, advertised: bool, sent: bool
) -> None:
    app = Celery("events", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.worker_send_task_events = setting
    OJSML(app)
    app.ojs_ml.use_store(store)

    @app.task(bind=True, name="t.step", shared=False)
    def step(self: Any) -> None:
        store.advertise(self.request.hostname, {}, {}, info={"task_events": advertised})
        progress(self, 4, 8, loss=0.5)

    headers = {h.LOGICAL: "train", h.BAND: "spot"}
    events = _events_of(app, lambda: step.apply(headers=headers))
    app.close()
    if not sent:
        assert events == []
        return
    [event] = events
    assert {k: event[k] for k in ("step", "total", "metrics", "eta_s", "queue", "band")} == {
        "step": 4,
        "total": 8,
        "metrics": {"loss": 0.5},
        "eta_s": None,
        "queue": "train",
        "band": "spot",
    }
