"""The final checkpoint: a job marks itself done in its last commit (DESIGN invariant 5).

`save(final=True, result=...)` writes the job's final record in the same atomic commit
as the checkpoint, so a copy of the job delivered again after its worker died is settled
with the recorded result instead of running the body once more (`worker.finished`).
"""

from __future__ import annotations

import json

import pytest

from celery_ojs_ml.checkpoint import Checkpointer, CheckpointError, LeaseLost, last_checkpoint
from celery_ojs_ml.store.checkpoints import final_of
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.registry import OJSStore
from tests.checkpoint.conftest import Backend

JOB = "0195f0a4-5678-7abc-8000-0000000000f1"


def test_a_final_save_records_the_result_with_its_checkpoint_in_one_commit(
    backend: Backend, store: OJSStore
) -> None:
    ckpt = Checkpointer(JOB, backend.settings(), store)
    ckpt.save(epoch=0, files={"a": b"0"})
    assert final_of(store, JOB) is None, "an ordinary save does not end the job"
    meta = ckpt.save(epoch=1, files={"a": b"1"}, final=True, result={"epochs": 2})
    assert final_of(store, JOB) == {"result": {"epochs": 2}, "sequence": meta.sequence}
    assert last_checkpoint(store, JOB) == meta


def test_a_final_result_that_is_not_json_is_refused_before_anything_is_committed(
    backend: Backend, store: OJSStore
) -> None:
    ckpt = Checkpointer(JOB, backend.settings(), store)
    with pytest.raises(CheckpointError) as info:
        ckpt.save(epoch=0, files={"a": b"0"}, final=True, result=object())
    assert "is not JSON" in str(info.value) and "final=True, result=" in str(info.value)
    assert last_checkpoint(store, JOB) is None and final_of(store, JOB) is None
    ckpt.save(epoch=0, files={"a": b"0"})  # the refused final does not ride on the next save
    assert final_of(store, JOB) is None


def test_a_commit_of_a_copy_whose_job_a_claimer_re_published_is_refused_once_its_lease_is_gone(
    backend: Backend, store: OJSStore
) -> None:
    """DESIGN invariant 5: the claimer marks the stalled copy's token taken back, then
    re-publishes and deletes the lease; the copy's next commit must not pass for one
    made before its lease was written."""
    mine = Checkpointer(JOB, backend.settings(), store, lease_token="t-stalled")
    store.client.set(store.lease_key(JOB), json.dumps({"task_id": JOB, "token": "t-stalled"}))
    kept = mine.save(epoch=0, files={"a": b"0"})
    book = LeaseBook(store, ttl_s=2)
    book.mark_taken_back(JOB, "t-stalled")
    store.client.delete(store.lease_key(JOB))  # the claimer's release
    with pytest.raises(LeaseLost):
        mine.save(epoch=1, files={"a": b"1"}, final=True, result=1)
    assert last_checkpoint(store, JOB) == kept and final_of(store, JOB) is None
    fresh = Checkpointer(JOB, backend.settings(), store, lease_token="t-new")
    assert (
        fresh.save(epoch=1, files={"a": b"1"}).epoch == 1
    )  # the new copy's lease is not written yet
