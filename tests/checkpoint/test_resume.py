"""Resume (OJS ML §9.3): where the last checkpoint comes from, and when a save is due."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from celery_ojs_ml.checkpoint import Checkpointer, CheckpointError, CheckpointMeta
from celery_ojs_ml.spec.normalize import Bounds
from celery_ojs_ml.store.registry import OJSStore
from tests.checkpoint.conftest import Backend, FakeClock

JOB = "resume-job"


class Events:
    """Collects what the checkpointer emits."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        self.sent.append((event, fields))


def test_without_any_checkpoint_resume_returns_none_and_warns_section_9_3(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    events = Events()
    ckpt = Checkpointer(JOB, file_backend.settings(), store, emit=events)

    with caplog.at_level(logging.WARNING):
        assert ckpt.resume() is None

    assert "resume-job has no valid checkpoint; starting from the beginning" in caplog.text
    assert events.sent == []


def test_resume_logs_the_epoch_and_step_and_sends_checkpoint_loaded_section_9_3(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    saved = Checkpointer(JOB, file_backend.settings(), store).save(epoch=7, step=700)
    events = Events()

    with caplog.at_level(logging.INFO):
        Checkpointer(JOB, file_backend.settings(), store, emit=events).resume()

    assert "resume-job resumes from checkpoint 1 (epoch 7, step 700)" in caplog.text
    assert events.sent == [("ojs-checkpoint-loaded", {**saved.to_dict(), "source": "store"})]


def test_a_save_sends_checkpoint_saved_with_the_committed_metadata_and_its_duration(
    file_backend: Backend, store: OJSStore
) -> None:
    events, clock = Events(), FakeClock()
    ckpt = Checkpointer(JOB, file_backend.settings(), store, emit=events, clock=clock)
    with ckpt.writer(epoch=1) as w:
        clock.advance(2.5)  # the payload takes 2.5 s to write

    assert events.sent == [("ojs-checkpoint-saved", {**w.meta.to_dict(), "duration_s": 2.5})]


def test_an_event_that_cannot_be_sent_does_not_fail_the_save(
    file_backend: Backend, store: OJSStore
) -> None:
    def broken(event: str, fields: dict[str, Any]) -> None:
        raise ConnectionError("broker down")

    meta = Checkpointer(JOB, file_backend.settings(), store, emit=broken).save(epoch=1)

    assert meta.sequence == 1


def test_a_header_the_store_has_nothing_of_is_used_when_the_operator_trusts_them_section_4_4(
    file_backend: Backend, store: OJSStore
) -> None:
    """v0.1 §4.4 short form; by default such a header must be committed (§15.3)."""
    key = f"{file_backend.storage_uri}{JOB}/3/"
    header = {"epoch": 42, "loss": 0.0234, "storage_key": key}
    settings = file_backend.settings(restore="own_directory")
    ckpt = Checkpointer(JOB, settings, store, header_last=header)

    resumed = ckpt.resume()

    assert resumed == CheckpointMeta(job_id=JOB, epoch=42, loss=0.0234, storage_key=key)


def test_the_committed_checkpoint_wins_over_the_header_and_resume_from(
    file_backend: Backend, store: OJSStore
) -> None:
    saved = Checkpointer(JOB, file_backend.settings(), store).save(epoch=9)
    header = {"epoch": 3, "storage_key": "s3://b/old/"}

    ckpt = Checkpointer(
        JOB, file_backend.settings(), store, header_last=header, resume_from="s3://b/x/"
    )

    assert ckpt.resume() == saved


def test_resume_from_names_the_checkpoint_when_nothing_else_exists_extensions_5_1(
    file_backend: Backend, store: OJSStore, tmp_path: Any
) -> None:
    weights = tmp_path / "pretrained.pt"
    weights.write_bytes(b"pretrained weights")
    settings = file_backend.settings(
        bounds=file_backend.bounds(artifact_prefixes=(f"file://{tmp_path}/",))
    )
    ckpt = Checkpointer(JOB, settings, store, resume_from=f"file://{weights}")

    resumed = ckpt.resume()

    assert resumed is not None
    assert resumed.storage_key == f"file://{weights}"
    assert (resumed.epoch, resumed.sequence) == (None, None)
    assert ckpt.load_bytes() == b"pretrained weights"


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ("not json", "is not JSON"),
        ({"epoch": "forty-two", "storage_key": "s3://b/k/"}, "epoch"),
        ({"epoch": 1}, "storage_key"),
        ({"epoch": 1, "storage_key": "http://169.254.169.254/latest/"}, "allowed schemes"),
        ({"epoch": 1, "storage_key": "s3://b/../../etc/"}, "path traversal"),
    ],
)
def test_an_invalid_or_untrusted_header_is_ignored_with_a_warning_section_15_3(
    header: Any,
    reason: str,
    file_backend: Backend,
    store: OJSStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(), store, header_last=header)

    with caplog.at_level(logging.WARNING):
        assert ckpt.resume() is None

    assert "ignoring the ojs_last_checkpoint header of resume-job" in caplog.text
    assert reason in caplog.text


def test_a_header_outside_the_allowed_prefixes_is_not_restored_section_15_3(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    bounds = Bounds(checkpoint_prefixes=(file_backend.storage_uri, "s3://team-a/"))
    header = {"epoch": 1, "storage_key": "s3://team-b/ckpt/job/1/"}
    ckpt = Checkpointer(JOB, file_backend.settings(bounds=bounds), store, header_last=header)

    assert ckpt.resume() is None
    assert "has storage_key 's3://team-b/ckpt/job/1/' outside this job's checkpoint" in caplog.text


def test_reading_a_file_without_a_checkpoint_to_resume_says_so(
    file_backend: Backend, store: OJSStore
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(), store)

    with pytest.raises(CheckpointError, match="has no checkpoint to read"):
        ckpt.load_bytes("model.pt")


def test_a_periodic_checkpoint_is_due_once_interval_s_has_passed_since_the_start(
    file_backend: Backend, store: OJSStore, clock: FakeClock
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(interval_s=300), store, clock=clock)

    clock.advance(299)
    assert ckpt.due() is False
    clock.advance(1)
    assert ckpt.due() is True


def test_saving_restarts_the_interval(
    file_backend: Backend, store: OJSStore, clock: FakeClock
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(interval_s=60), store, clock=clock)
    clock.advance(61)
    ckpt.save(epoch=0)

    assert ckpt.due() is False
    clock.advance(60)
    assert ckpt.due() is True


def test_nothing_is_ever_due_when_periodic_checkpointing_is_disabled_section_9_1(
    file_backend: Backend, store: OJSStore, clock: FakeClock
) -> None:
    ckpt = Checkpointer(JOB, file_backend.settings(enabled=False), store, clock=clock)

    clock.advance(10 * 86400)

    assert ckpt.due() is False


def test_an_untrusted_resume_from_uri_is_ignored_with_a_warning_section_15_3(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    uri = "http://169.254.169.254/latest/meta-data/"
    ckpt = Checkpointer(JOB, file_backend.settings(), store, resume_from=uri)

    with caplog.at_level(logging.WARNING):
        assert ckpt.resume() is None

    assert f"ignoring ext_mlx_training_resume_from: it has storage_key {uri!r} that" in caplog.text
    assert "starting from the beginning" in caplog.text
