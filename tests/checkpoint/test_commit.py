"""The two-phase commit, the §9.2 metadata schema and FIFO retention, on file:// and s3://."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from celery_ojs_ml.checkpoint import (
    Checkpointer,
    CheckpointError,
    delete_checkpoints,
    last_checkpoint,
    list_checkpoints,
)
from celery_ojs_ml.store.registry import OJSStore
from tests.checkpoint.conftest import Backend, FakeClock, s3_options

JOB = "0195f0a4-5678-7abc-8000-000000000002"


def _ckpt(backend: Backend, store: OJSStore, **settings: Any) -> Checkpointer:
    return Checkpointer(JOB, backend.settings(**settings), store)


def test_a_saved_checkpoint_is_what_the_next_run_resumes_from(
    backend: Backend, store: OJSStore
) -> None:
    saved = _ckpt(backend, store).save(
        epoch=4, step=1200, loss=0.25, metrics={"accuracy": 0.9}, files={"model.pt": b"weights-4"}
    )

    rerun = _ckpt(backend, store)
    resumed = rerun.resume()

    assert resumed == saved
    assert rerun.load_bytes("model.pt") == b"weights-4"
    assert backend.read(saved.storage_key + "model.pt") == b"weights-4"


def test_section_9_2_metadata_carries_the_required_fields_with_their_wire_names(
    file_backend: Backend, store: OJSStore, clock: FakeClock
) -> None:
    clock.now = 1_771_502_400.25  # 2026-02-19T12:00:00.250Z
    ckpt = Checkpointer(JOB, file_backend.settings(), store, clock=clock)
    ckpt.save(
        epoch=42,
        step=126000,
        loss=0.0234,
        metrics={"accuracy": 0.947, "learning_rate": 0.0001},
        files={"model.pt": b"12345", "optim/state.pt": b"678"},
    )

    raw = store.client.get(store.key("ckpt", JOB, "last"))
    assert raw is not None
    assert json.loads(raw) == {
        "job_id": JOB,
        "epoch": 42,
        "step": 126000,
        "loss": 0.0234,
        "metrics": {"accuracy": 0.947, "learning_rate": 0.0001},
        "storage_key": f"{file_backend.storage_uri}{JOB}/1/",
        "created_at": "2026-02-19T12:00:00.250Z",
        "sequence": 1,
        "size_bytes": 8,
        "files": ["model.pt", "optim/state.pt"],
    }


def test_the_payload_lives_under_storage_uri_job_id_and_sequence_design_decision_6(
    backend: Backend, store: OJSStore
) -> None:
    ckpt = _ckpt(backend, store)
    first = ckpt.save(epoch=0, files={"model.pt": b"a"})
    second = ckpt.save(epoch=1, files={"model.pt": b"b"})

    assert first.storage_key == f"{backend.storage_uri}{JOB}/1/"
    assert second.storage_key == f"{backend.storage_uri}{JOB}/2/"
    assert backend.find(backend.storage_uri + JOB) == ["1/model.pt", "2/model.pt"]


def test_fifo_retention_keeps_the_newest_max_count_and_deletes_older_payloads_section_9_2(
    backend: Backend, store: OJSStore
) -> None:
    ckpt = _ckpt(backend, store, max_count=2)
    saved = [ckpt.save(epoch=e, files={"model.pt": f"w{e}".encode()}) for e in range(4)]

    kept = list_checkpoints(store, JOB)
    assert [m.epoch for m in kept] == [2, 3]
    assert last_checkpoint(store, JOB) == saved[-1]
    assert not backend.exists(saved[0].storage_key + "model.pt")
    assert not backend.exists(saved[1].storage_key + "model.pt")
    assert backend.find(backend.storage_uri + JOB) == ["3/model.pt", "4/model.pt"]
    assert store.client.llen(store.key("ckpt", JOB, "expired")) == 0


_CRASH_BEFORE_COMMIT = textwrap.dedent(
    """
    import json, os, sys
    import redis
    from celery_ojs_ml.checkpoint import Checkpointer, CheckpointSettings
    from celery_ojs_ml.spec.bounds import Bounds
    from celery_ojs_ml.store.registry import OJSStore

    url, prefix, job, uri, options = sys.argv[1:]
    store = OJSStore(redis.Redis.from_url(url), prefix=prefix)
    bounds = Bounds(checkpoint_prefixes=(uri,))  # a file:// prefix must be granted
    settings = CheckpointSettings(
        storage_uri=uri, storage_options=json.loads(options), bounds=bounds
    )
    ckpt = Checkpointer(job, settings, store)

    def crash(meta):
        print(meta.storage_key, flush=True)
        os._exit(1)

    ckpt._before_commit = crash
    ckpt.save(epoch=1, step=200, files={"model.pt": b"epoch-1 weights"})
    print("committed", flush=True)
    """
)


def test_a_payload_written_by_a_process_that_died_before_the_commit_never_exists_for_resume(
    backend: Backend, store: OJSStore, redis_url: str, child_env: dict[str, str]
) -> None:
    """OJS ML §9.2: partial checkpoints (weights written, metadata not) are non-existent."""
    committed = _ckpt(backend, store).save(epoch=0, step=100, files={"model.pt": b"epoch-0"})
    prefix = store.key().split(":{ml}")[0]
    argv = [sys.executable, "-c", _CRASH_BEFORE_COMMIT, redis_url, prefix, JOB]
    argv += [backend.storage_uri, json.dumps(backend.options)]

    child = subprocess.run(argv, capture_output=True, text=True, env=child_env, timeout=60)

    assert child.returncode == 1, child.stderr
    orphan = child.stdout.strip()
    assert orphan.startswith(f"{backend.storage_uri}{JOB}/") and orphan != committed.storage_key
    assert backend.read(orphan + "model.pt") == b"epoch-1 weights"
    rerun = _ckpt(backend, store)
    assert rerun.resume() == committed
    assert rerun.load_bytes("model.pt") == b"epoch-0"
    assert list_checkpoints(store, JOB) == [committed]
    again = rerun.save(epoch=1, files={"model.pt": b"again"})
    assert again.storage_key != orphan
    assert backend.read(orphan + "model.pt") == b"epoch-1 weights"


def test_deleting_a_jobs_checkpoints_with_its_storage_uri_also_removes_orphaned_payloads(
    backend: Backend, store: OJSStore
) -> None:
    _ckpt(backend, store).save(epoch=0, files={"model.pt": b"a"})
    fs, path = backend.fs(f"{backend.storage_uri}{JOB}/9/model.pt")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, b"orphan: written, never committed")

    forgotten = delete_checkpoints(
        store, JOB, storage_uri=backend.storage_uri, storage_options=backend.options
    )

    assert [m.epoch for m in forgotten] == [0]
    assert list_checkpoints(store, JOB) == []
    assert last_checkpoint(store, JOB) is None
    assert backend.find(backend.storage_uri) == []


def _refuse(meta: Any) -> None:
    raise RuntimeError(f"refusing to commit {meta.storage_key}")


def test_a_failure_before_the_commit_removes_the_payload_and_commits_nothing(
    backend: Backend, store: OJSStore
) -> None:
    ckpt = _ckpt(backend, store)
    first = ckpt.save(epoch=0, files={"model.pt": b"a"})
    ckpt._before_commit = _refuse

    with pytest.raises(RuntimeError, match="refusing to commit"):
        ckpt.save(epoch=1, files={"model.pt": b"b"})

    assert last_checkpoint(store, JOB) == first
    assert not backend.exists(f"{backend.storage_uri}{JOB}/2/model.pt")


def test_an_eviction_that_cannot_delete_the_payload_keeps_the_commit_and_retries_later(
    s3_backend: Backend, file_backend: Backend, store: OJSStore, s3_endpoint: str
) -> None:
    """The job moved from S3 to a worker whose S3 endpoint is down: eviction fails there."""
    on_s3 = Checkpointer(JOB, s3_backend.settings(max_count=1), store).save(
        epoch=0, files={"model.pt": b"s3"}
    )
    dead = {"s3://": s3_options("http://127.0.0.1:9")}
    local = Checkpointer(JOB, file_backend.settings(max_count=1), store, app_conf=_conf(dead))

    newer = local.save(epoch=1, files={"model.pt": b"local"})

    assert last_checkpoint(store, JOB) == newer
    assert list_checkpoints(store, JOB) == [newer]
    assert s3_backend.exists(on_s3.storage_key + "model.pt")
    live = {"s3://": s3_options(s3_endpoint)}
    retry = Checkpointer(JOB, file_backend.settings(max_count=1), store, app_conf=_conf(live))
    assert retry.evict_expired() == 1
    assert not s3_backend.exists(on_s3.storage_key + "model.pt")
    assert last_checkpoint(store, JOB) == newer


def _conf(options: dict[str, Any]) -> dict[str, Any]:
    return {"ojs_ml_checkpoint_storage_options": options}


def test_saving_without_a_storage_uri_says_which_attribute_to_set(store: OJSStore) -> None:
    from celery_ojs_ml.checkpoint import CheckpointSettings

    ckpt = Checkpointer(JOB, CheckpointSettings(), store)

    with pytest.raises(CheckpointError) as info:
        ckpt.save(epoch=0, files={"model.pt": b"x"})

    assert str(info.value) == (
        "ext_ml_checkpoint_storage_uri is not set, so there is nowhere to save a checkpoint "
        '(OJS ML §9.1); set it, e.g. ml={"ext_ml_checkpoint_storage_uri": '
        '"s3://bucket/checkpoints/"}'
    )


def test_a_commit_is_fenced_by_the_lease_token_of_its_run(
    backend: Backend, store: OJSStore
) -> None:
    """DESIGN invariant 5: once another worker holds the lease, this run commits nothing."""
    from celery_ojs_ml.checkpoint import LeaseLost

    lease = store.lease_key(JOB)
    settings = backend.settings()
    mine = Checkpointer(JOB, settings, store, lease_token="t-mine")
    first = mine.save(epoch=0, files={"a": b"0"})  # no lease yet (written later): allowed
    store.client.set(lease, json.dumps({"task_id": JOB, "token": "t-mine"}))
    second = mine.save(epoch=1, files={"a": b"1"})  # our own lease: allowed
    store.client.set(lease, json.dumps({"task_id": JOB, "token": "t-claimer"}))
    with pytest.raises(LeaseLost):
        mine.save(epoch=2, files={"a": b"2"})
    assert last_checkpoint(store, JOB) == second
    assert [c.sequence for c in list_checkpoints(store, JOB)] == [first.sequence, second.sequence]
    unfenced = Checkpointer(JOB, settings, store)  # no token (e.g. eager apply): not fenced
    assert unfenced.save(epoch=3, files={"a": b"3"}).epoch == 3
