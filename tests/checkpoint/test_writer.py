"""The streaming writer and the file sources `save(files=...)` accepts."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from celery_ojs_ml.checkpoint import Checkpointer, CheckpointError, last_checkpoint
from celery_ojs_ml.checkpoint.records import last_checkpoints
from celery_ojs_ml.checkpoint.storage import Source
from celery_ojs_ml.store.registry import OJSStore
from tests.checkpoint.conftest import Backend

JOB = "writer-job"


def test_a_streamed_checkpoint_commits_when_the_with_block_ends_cleanly(
    backend: Backend, store: OJSStore
) -> None:
    ckpt = Checkpointer(JOB, backend.settings(), store)

    with ckpt.writer(epoch=2, step=20, loss=0.5) as w:
        with w.open("model.pt") as f:
            for chunk in (b"part-1|", b"part-2"):
                f.write(chunk)
        w.write("optim.pt", b"optimizer")
        assert last_checkpoint(store, JOB) is None

    assert w.meta == last_checkpoint(store, JOB)
    assert w.meta.files == ["model.pt", "optim.pt"]
    assert w.meta.size_bytes == len(b"part-1|part-2") + len(b"optimizer")
    assert backend.read(w.storage_key + "model.pt") == b"part-1|part-2"


def test_a_streamed_checkpoint_that_raises_is_not_committed_and_its_files_are_removed(
    backend: Backend, store: OJSStore
) -> None:
    ckpt = Checkpointer(JOB, backend.settings(), store)
    previous = ckpt.save(epoch=0, files={"model.pt": b"good"})

    with pytest.raises(ValueError, match="diverged"), ckpt.writer(epoch=1) as w:
        w.write("optim.pt", b"written before the failure")
        with w.open("model.pt") as f:
            f.write(b"half a tensor")
            raise ValueError("loss diverged")

    assert last_checkpoint(store, JOB) == previous
    assert backend.find(f"{backend.storage_uri}{JOB}") == ["1/model.pt"]
    with pytest.raises(CheckpointError, match="not committed yet"):
        _ = w.meta


@pytest.mark.parametrize(
    "kind",
    ["bytes", "bytearray", "memoryview", "BytesIO at its end", "open file", "str path", "Path"],
)
def test_save_accepts_every_documented_kind_of_file_source(
    kind: str, file_backend: Backend, store: OJSStore, tmp_path: Path
) -> None:
    data = b"\x00weights\xff" * 1000
    local = tmp_path / "model.bin"
    local.write_bytes(data)
    buffer = io.BytesIO()
    buffer.write(data)
    ckpt = Checkpointer(JOB, file_backend.settings(), store)

    with local.open("rb") as handle:
        sources: dict[str, Source] = {
            "bytes": data,
            "bytearray": bytearray(data),
            "memoryview": memoryview(data),
            "BytesIO at its end": buffer,
            "open file": handle,
            "str path": str(local),
            "Path": local,
        }
        meta = ckpt.save(epoch=0, files={"model.bin": sources[kind]})

    assert file_backend.read(meta.storage_key + "model.bin") == data
    assert meta.size_bytes == len(data)


@pytest.mark.parametrize("name", ["", "../escape.pt", "/abs.pt", "a//b.pt", "a/./b", "a\\b"])
def test_a_file_name_that_could_escape_the_checkpoint_directory_is_refused(
    name: str, file_backend: Backend, store: OJSStore
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(), store)

    with pytest.raises(CheckpointError, match="must be a relative path"):
        ckpt.save(epoch=0, files={name: b"x"})

    assert last_checkpoint(store, JOB) is None


def test_writing_the_same_file_twice_in_one_checkpoint_is_refused(
    file_backend: Backend, store: OJSStore
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(), store)

    with pytest.raises(CheckpointError, match="written twice"), ckpt.writer(epoch=0) as w:
        w.write("model.pt", b"a")
        w.write("model.pt", b"b")

    assert last_checkpoint(store, JOB) is None


def test_metrics_that_are_not_json_are_refused_before_anything_is_written(
    file_backend: Backend, store: OJSStore
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(), store)

    with pytest.raises(CheckpointError) as info:
        ckpt.save(epoch=0, metrics={"tensor": object()}, files={"model.pt": b"x"})

    assert "metrics that are not JSON values" in str(info.value)
    assert 'metrics={"accuracy": float(acc)}' in str(info.value)
    assert file_backend.find(file_backend.storage_uri) == []


def test_a_non_finite_loss_is_recorded_as_null() -> None:
    from celery_ojs_ml.checkpoint.model import build_meta

    meta = build_meta({"job_id": JOB, "loss": float("nan"), "storage_key": "file:///c/"})

    assert meta.loss is None
    assert meta.to_dict()["loss"] is None


def test_a_job_id_that_would_escape_the_storage_prefix_is_refused(
    file_backend: Backend, store: OJSStore
) -> None:
    with pytest.raises(CheckpointError, match="cannot name a checkpoint directory"):
        Checkpointer("../other-job", file_backend.settings(), store)


def test_the_last_checkpoints_of_many_jobs_read_at_once_match_one_by_one(
    file_backend: Backend, store: OJSStore
) -> None:
    """The leader reads every running job's last checkpoint in one round trip per pass."""
    saved = {
        job: Checkpointer(job, file_backend.settings(), store).save(
            epoch=n, files={"model.pt": b"w"}
        )
        for n, job in enumerate(["job-a", "job-b"])
    }
    found = last_checkpoints(store, ["job-a", "never-saved", "job-b"])
    assert found == {"job-a": saved["job-a"], "never-saved": None, "job-b": saved["job-b"]}
    assert all(found[j] == last_checkpoint(store, j) for j in found)
    assert last_checkpoints(store, []) == {}
