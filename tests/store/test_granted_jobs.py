"""The record of a job sent under a grant (`store.granted_jobs`), on a real Redis."""

from __future__ import annotations

from typing import Any

import pytest

from celery_ojs_ml.producer.routing import without_private
from celery_ojs_ml.store import granted_jobs
from celery_ojs_ml.store.leases import LeaseBook, LeaseWriter
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h

MSG: dict[str, Any] = {"body": "W10=", "headers": {"id": "t1", h.MSG: "m1"}, "properties": {}}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clocked(store: OJSStore) -> OJSStore:
    store._clock = Clock()  # type: ignore[method-assign]
    return store


def test_a_recorded_job_is_left_by_its_holder_until_it_is_forgotten(clocked: OJSStore) -> None:
    granted_jobs.record(clocked, "w1@h", "t1", MSG)
    granted_jobs.record(clocked, "w1@h", "t2", {**MSG, "headers": {"id": "t2"}})
    assert [t for t, _ in granted_jobs.left_by(clocked, "w1@h")] == ["t1", "t2"]
    assert granted_jobs.left_by(clocked, "w1@h")[0][1] == MSG
    assert granted_jobs.holders(clocked) == {"w1@h"}
    granted_jobs.forget(clocked, "w1@h", ["t1"])
    assert [t for t, _ in granted_jobs.left_by(clocked, "w1@h")] == ["t2"]


def test_a_holder_is_dropped_from_the_index_only_once_it_has_no_record(clocked: OJSStore) -> None:
    granted_jobs.record(clocked, "w1@h", "t1", MSG)
    assert granted_jobs.drop_holder(clocked, "w1@h") is False
    granted_jobs.forget(clocked, "w1@h", ["t1"])
    assert granted_jobs.drop_holder(clocked, "w1@h") is True
    assert granted_jobs.holders(clocked) == set()


def test_a_record_older_than_keep_s_is_dropped_not_returned(clocked: OJSStore) -> None:
    """Admission remembers a message id for a day: an older record could run a job again."""
    granted_jobs.record(clocked, "w1@h", "t1", MSG)
    clocked._clock.now += granted_jobs.KEEP_S + 1  # type: ignore[attr-defined]
    assert granted_jobs.left_by(clocked, "w1@h") == []
    assert clocked.client.hlen(granted_jobs.key(clocked, "w1@h")) == 0


def test_the_lease_writer_forgets_a_record_synchronously_without_an_event_loop(
    clocked: OJSStore,
) -> None:
    granted_jobs.record(clocked, "w1@h", "t1", MSG)
    writer = LeaseWriter(LeaseBook(clocked, 30.0))
    writer.forget(granted_jobs.key(clocked, "w1@h"), "t1")
    assert granted_jobs.left_by(clocked, "w1@h") == []


def test_the_lease_writer_forgets_records_with_its_next_batch_when_deferring(
    clocked: OJSStore,
) -> None:
    granted_jobs.record(clocked, "w1@h", "t1", MSG)
    granted_jobs.record(clocked, "w1@h", "t2", MSG)
    timers: list[Any] = []
    writer = LeaseWriter(LeaseBook(clocked, 30.0), defer=lambda fn, _s: timers.append(fn))
    writer.forget(granted_jobs.key(clocked, "w1@h"), "t1")
    writer.forget(granted_jobs.key(clocked, "w1@h"), "t2")
    assert len(granted_jobs.left_by(clocked, "w1@h")) == 2, "queued, not sent yet"
    writer.flush(wait=True)
    assert granted_jobs.left_by(clocked, "w1@h") == []


def test_the_router_drops_every_private_header_and_keeps_the_public_ones() -> None:
    sent = {**dict.fromkeys(h.PRIVATE, 1), h.LABELS: {"a": "b"}, h.LOGICAL: "q", "x": 1}
    sent["ojs_ml_gpu_share"] = 0.5
    kept = without_private(sent)
    assert set(kept) == {h.LABELS, h.LOGICAL, "x", "ojs_ml_gpu_share"}
    assert set(sent) >= h.PRIVATE, "the caller's own dict is left as it was"


def test_the_plugins_own_publishes_are_trusted_only_inside_plugin_publish() -> None:
    assert not h.trusted()
    with h.plugin_publish():
        with h.plugin_publish():
            assert h.trusted()
        assert h.trusted()
    assert not h.trusted()
