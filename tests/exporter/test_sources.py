"""What the exporter reads that other processes write: the leader's last pass in its lock."""

from __future__ import annotations

from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore


def test_a_renewal_keeps_the_leaders_last_pass_in_the_lock_record(store: OJSStore) -> None:
    book = PendingBook(store)
    assert book.lead("sched-a", 30.0)
    first = book.leader()
    assert first is not None and "pass_s" not in first

    assert book.lead("sched-a", 30.0, pass_s=0.125)
    assert book.leader() == {**first, "pass_s": 0.125}
    assert book.lead("sched-a", 30.0), "a renewal without a figure keeps the last one"
    assert book.leader() == {**first, "pass_s": 0.125}
    assert book.lead("sched-b", 30.0, pass_s=9.0) is False
    assert store.client.pttl(store.key("scheduler", "leader")) > 29_000
