"""The Celery priority at the gate and on a delivery (RFC 27 prioritize)."""

from __future__ import annotations

from celery_ojs_ml.leader.delivery import _prioritized
from celery_ojs_ml.worker.gate import band_priority


def test_the_gate_reads_the_celery_priority_a_request_keeps_in_its_delivery_info() -> None:
    assert band_priority({"delivery_info": {"priority": 7}}) == 7
    assert band_priority({"priority": 3, "delivery_info": {"priority": 7}}) == 3
    assert band_priority({"delivery_info": {"priority": None}}) == 0
    assert band_priority({}) == 0


def test_a_delivery_carries_the_priority_the_pending_set_holds() -> None:
    props = {"priority": 2, "correlation_id": "x"}
    assert _prioritized(props, "9") == {"priority": 9, "correlation_id": "x"}
    assert props["priority"] == 2  # the stored message is not changed
    assert _prioritized(props, None) is props
    assert _prioritized(props, "2") is props
    assert _prioritized({}, "0") == {}
