"""`checkpoint(self)` inside real Celery tasks (eager `apply()` on an in-memory broker)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kombu
import pytest
from celery import Celery

from celery_ojs_ml import OJSML
from celery_ojs_ml.checkpoint import (
    Checkpointer,
    CheckpointMeta,
    checkpoint,
    last_checkpoint,
    list_checkpoints,
    register_storage_options,
    request_preemption,
)
from celery_ojs_ml.errors import ConfigError, SpecError
from celery_ojs_ml.store.registry import OJSStore
from tests.checkpoint.conftest import Backend, s3_options

JOB = "celery-job-1"
_KOMBU: Any = kombu
"""kombu ships no type hints."""


@pytest.fixture
def app(store: OJSStore, tmp_path: Path) -> Celery:
    """A Celery app with the plugin on the test store; tasks run eagerly via `apply()`."""
    app = Celery("ckpt-tests", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.ojs_ml_checkpoint_prefixes = [f"file://{tmp_path}/", "s3://"]  # both backends
    OJSML(app)
    app.ojs_ml.use_store(store)
    return app


class Events:
    """Reads the events tasks send from a queue bound to the broker's `celeryev` exchange."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue

    def drain(self) -> list[dict[str, Any]]:
        """Every event sent since the last drain."""
        out = []
        while (message := self._queue.get(no_ack=True)) is not None:
            out.append(message.payload)
        return out


@pytest.fixture
def events(app: Celery) -> Iterator[Events]:
    """The events the tasks of `app` send."""
    with app.connection_for_write() as conn:
        exchange = _KOMBU.Exchange("celeryev", type="topic")
        queue = _KOMBU.Queue("ckpt-events", exchange, routing_key="#", channel=conn)
        queue.declare()
        yield Events(queue)


def _train_task(app: Any, ml: dict[str, Any], *, save_every_epoch: bool = False) -> Any:
    @app.task(bind=True, shared=False, name="ckpt.train", ml=ml)  # type: ignore[untyped-decorator]
    def train(self: Any, epochs: int) -> list[int]:
        ckpt = checkpoint(self)
        last = ckpt.resume()
        ran = []
        for epoch in range(last.epoch + 1 if last and last.epoch is not None else 0, epochs):
            ran.append(epoch)
            if save_every_epoch or ckpt.due() or ckpt.preempt_requested:
                ckpt.save(epoch=epoch, step=epoch * 10, files={"model.pt": f"w{epoch}".encode()})
            ckpt.yield_if_preempted()
        return ran

    return train


def _ml(backend: Backend, **extra: Any) -> dict[str, Any]:
    return {
        "ext_ml_checkpoint_enabled": True,
        "ext_ml_checkpoint_interval_s": 3600,
        "ext_ml_checkpoint_storage_uri": backend.storage_uri,
        **extra,
    }


def test_a_preempted_task_yields_and_its_rerun_resumes_after_the_saved_epoch(
    app: Celery, backend: Backend, store: OJSStore
) -> None:
    register_storage_options(backend.storage_uri, **backend.options)
    train = _train_task(app, _ml(backend, ext_ml_checkpoint_on_preempt=True))
    request_preemption(store, JOB, grace_s=30)

    first = train.apply(args=(5,), task_id=JOB)
    rerun = train.apply(args=(5,), task_id=JOB)

    assert first.state == "IGNORED"
    assert [(m.epoch, m.sequence) for m in list_checkpoints(store, JOB)] == [(0, 1)]
    assert rerun.get() == [1, 2, 3, 4]


def test_the_ojs_ml_checkpoint_storage_options_setting_reaches_the_s3_backend(
    app: Celery, s3_backend: Backend, s3_endpoint: str, store: OJSStore
) -> None:
    app.conf.ojs_ml_checkpoint_storage_options = {"s3://": s3_options(s3_endpoint)}
    train = _train_task(app, _ml(s3_backend), save_every_epoch=True)

    assert train.apply(args=(2,), task_id=JOB).get() == [0, 1]

    saved = list_checkpoints(store, JOB)
    assert [m.storage_key for m in saved] == [f"{s3_backend.storage_uri}{JOB}/{n}/" for n in (1, 2)]
    assert s3_backend.read(saved[-1].storage_key + "model.pt") == b"w1"


def test_checkpoint_events_carry_the_task_id_and_never_use_the_task_prefix(
    app: Celery, file_backend: Backend, store: OJSStore, events: Events
) -> None:
    train = _train_task(app, _ml(file_backend))
    request_preemption(store, JOB, grace_s=30)
    train.apply(args=(3,), task_id=JOB)
    train.apply(args=(1,), task_id=JOB)

    sent = events.drain()
    saved = [e for e in sent if e["type"] == "ojs-checkpoint-saved"]
    loaded = [e for e in sent if e["type"] == "ojs-checkpoint-loaded"]
    assert [(e["uuid"], e["epoch"], e["sequence"]) for e in saved] == [(JOB, 0, 1)]
    assert [(e["uuid"], e["epoch"], e["source"]) for e in loaded] == [(JOB, 0, "store")]
    assert not [e for e in sent if e["type"].startswith("task-")]


def test_the_last_checkpoint_header_of_a_republished_copy_is_resumed_from(
    app: Celery, file_backend: Backend, store: OJSStore
) -> None:
    train = _train_task(app, _ml(file_backend, ext_ml_checkpoint_on_preempt=True))
    request_preemption(store, JOB, grace_s=30)
    train.apply(args=(4,), task_id=JOB)
    committed = last_checkpoint(store, JOB)
    assert committed is not None
    header = committed.to_dict()  # what the worker puts on the re-published copy

    result = train.apply(args=(4,), task_id=JOB, headers={"ojs_last_checkpoint": header})

    assert result.get() == [1, 2, 3]


def test_a_forged_last_checkpoint_header_makes_the_task_start_from_the_beginning_section_15_3(
    app: Celery, file_backend: Backend
) -> None:
    """OJS ML §15.3: workers MUST NOT restore checkpoints from untrusted sources."""
    train = _train_task(app, _ml(file_backend))
    header = {"epoch": 2, "step": 20, "storage_key": f"{file_backend.storage_uri}{JOB}/1/"}

    result = train.apply(args=(4,), task_id=JOB, headers={"ojs_last_checkpoint": header})

    assert result.get() == [0, 1, 2, 3]


def test_the_ojs_ml_checkpoint_restore_setting_reaches_the_task(
    app: Celery, file_backend: Backend
) -> None:
    app.conf.ojs_ml_checkpoint_restore = "own_directory"
    train = _train_task(app, _ml(file_backend))
    header = {"epoch": 2, "step": 20, "storage_key": f"{file_backend.storage_uri}{JOB}/1/"}

    result = train.apply(args=(4,), task_id=JOB, headers={"ojs_last_checkpoint": header})

    assert result.get() == [3]


def test_per_call_headers_override_the_tasks_ml_option(
    app: Celery, file_backend: Backend, store: OJSStore
) -> None:
    other = f"{file_backend.storage_uri}per-call/"
    train = _train_task(app, _ml(file_backend), save_every_epoch=True)

    train.apply(args=(1,), task_id=JOB, headers={"ext_ml_checkpoint_storage_uri": other})

    assert [m.storage_key for m in list_checkpoints(store, JOB)] == [f"{other}{JOB}/1/"]


def test_worker_requests_expose_headers_as_attributes_and_those_are_read(
    app: Celery, file_backend: Backend
) -> None:
    """A worker's `Context` carries custom headers as attributes (research §3)."""
    app.conf.ojs_ml_checkpoint_restore = "own_directory"  # trust the header without a commit
    task = _train_task(app, {})
    last = {"epoch": 6, "storage_key": f"{file_backend.storage_uri}{JOB}/4/"}
    task.push_request(
        id=JOB,
        ext_ml_checkpoint_storage_uri=file_backend.storage_uri,
        ext_ml_checkpoint_max_count=7,
        ojs_last_checkpoint=last,
    )
    try:
        ckpt = checkpoint(task)
    finally:
        task.pop_request()

    assert (ckpt.job_id, ckpt.settings.storage_uri) == (JOB, file_backend.storage_uri)
    assert ckpt.settings.max_count == 7
    assert ckpt.resume() == CheckpointMeta(job_id=JOB, **last)


def test_the_package_itself_is_callable_whichever_name_a_task_imported(
    app: Celery, file_backend: Backend
) -> None:
    import celery_ojs_ml
    import celery_ojs_ml.checkpoint.preempt  # binds celery_ojs_ml.checkpoint to the package

    task = _train_task(app, _ml(file_backend))
    task.push_request(id=JOB)
    package: Any = celery_ojs_ml.checkpoint  # mypy sees a module; at run time it is callable
    try:
        helper = package(task)
    finally:
        task.pop_request()

    assert isinstance(helper, Checkpointer)
    assert helper.settings.storage_uri == file_backend.storage_uri


def test_calling_checkpoint_outside_a_running_task_explains_bind_true(app: Celery) -> None:
    task = _train_task(app, {})

    with pytest.raises(ConfigError, match="declare the task with bind=True"):
        checkpoint(task)


def test_a_task_whose_ml_option_has_a_bad_storage_uri_fails_naming_the_attribute(
    app: Celery,
) -> None:
    train = _train_task(app, {"ext_ml_checkpoint_storage_uri": "ftp://files.example.com/c/"})

    result = train.apply(args=(1,), task_id=JOB)

    assert isinstance(result.result, SpecError)
    assert result.result.paths == ["ext_ml_checkpoint_storage_uri"]


def test_an_app_without_the_plugin_is_told_to_install_it(file_backend: Backend) -> None:
    bare = Celery("bare", broker="memory://", set_as_current=False)
    task = _train_task(bare, _ml(file_backend))
    task.push_request(id=JOB)
    try:
        with pytest.raises(ConfigError, match=r"install it, e.g. `OJSML\(app\)`"):
            checkpoint(task)
    finally:
        task.pop_request()
