"""A pending record with foreign `ojs_*` values still becomes a valid `PendingJob`: one
bad record must never stop the scheduler's passes (found by the header fuzz test)."""

from __future__ import annotations

from typing import Any

import pytest

from celery_ojs_ml.integration.fleet_view import pending_job
from celery_ojs_ml.spec.normalize import normalize


def _parse(headers: Any) -> Any:
    return normalize({"ext_ml_gpu_count": 1}).requirements


@pytest.mark.parametrize(
    ("band", "queue"), [("abc", "celery"), (None, ["x"]), (3, {"a": 1}), ("spot", "")]
)
def test_a_foreign_band_or_queue_is_recomputed_not_trusted(band: Any, queue: Any) -> None:
    record = {"meta": {"band": band, "queue": queue}, "msg": {"headers": {"ojs_band": band}}}
    job = pending_job("t", record, _parse)
    assert job is not None
    assert job.band in ("reserved", "on-demand", "spot")
    assert job.band == (band if band == "spot" else "on-demand")
    assert isinstance(job.queue, str) and job.queue
