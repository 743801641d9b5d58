"""The worker's heartbeat (`worker.advertising.Advertiser`): what its `info` tells the
leader, with a real allocator and a store that records what it is given."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_ojs_ml.allocator import Allocator
from celery_ojs_ml.testing.builders import worker_with
from celery_ojs_ml.worker import advertising
from celery_ojs_ml.worker.advertising import Advertiser


class _Store:
    """Records each heartbeat's `info`."""

    def __init__(self) -> None:
        self.infos: list[dict[str, Any]] = []

    def advertise(self, *args: Any, info: dict[str, Any], **kwargs: Any) -> None:
        self.infos.append(info)


def _echo(x: int) -> int:
    return x


def _advertiser(app: Celery) -> tuple[Advertiser, _Store]:
    caps = worker_with(gpus=1)
    settings: Any = SimpleNamespace(heartbeat_s=1.0)
    advertiser = Advertiser(
        app, SimpleNamespace(), settings, caps, Allocator(caps), threading.RLock(),
        "w@host", "10.0.0.1", prefork=False,
    )  # fmt: skip
    store = _Store()
    advertiser.open(store, None, lambda commands, again: False)  # type: ignore[arg-type]
    return advertiser, store


def test_the_heartbeat_names_the_tasks_that_batch_their_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A leader whose process never imported a batched task reads it here (`info.batching`):
    only a `max_size` of 2 or more batches; the registry is read again only when it grew."""
    app = Celery("serving", set_as_current=False)
    declared: dict[str, dict[str, Any]] = {
        "serve": {"ml_batch": {"max_size": 8, "max_wait_ms": 5}},
        "single": {"ml_batch": {"max_size": 1}},
        "broken": {"ml_batch": {"max_size": 0}},
        "train": {},
    }
    for name, options in declared.items():
        app.task(name=name, shared=False, **options)(_echo)
    scans: list[int] = []
    scan = advertising.batching_tasks

    def counted(tasks: Any) -> list[str]:
        scans.append(len(tasks))
        return scan(tasks)

    monkeypatch.setattr(advertising, "batching_tasks", counted)
    advertiser, store = _advertiser(app)
    advertiser.advertise()
    advertiser.advertise()
    assert [info["batching"] for info in store.infos] == [["serve"], ["serve"]]
    assert len(scans) == 1, "an unchanged registry is not scanned again"
    app.task(name="embed", shared=False, ml_batch={"max_size": 4})(_echo)  # a lazy import
    advertiser.advertise()
    assert store.infos[-1]["batching"] == ["embed", "serve"]
    assert store.infos[-1]["plain_running"] == 0, "the other fields are still there"


def test_a_worker_without_batched_tasks_advertises_an_empty_list() -> None:
    advertiser, store = _advertiser(Celery("plain", set_as_current=False))
    advertiser.advertise()
    assert len(store.infos) == 1 and store.infos[0]["batching"] == []
