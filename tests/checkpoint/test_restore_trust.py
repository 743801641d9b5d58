"""What a job may restore from (OJS ML §15.3: workers MUST NOT restore from untrusted sources).

By default a checkpoint is restored only when it is this job's (its `job_id`),
lies in this job's own payload directory (`<ext_ml_checkpoint_storage_uri><job id>/`)
and is committed in the store. Anything else in an `ojs_last_checkpoint` header
is ignored with a warning, and the job resumes from the store's committed
record or starts from the beginning; it never crashes.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from celery_ojs_ml.checkpoint import Checkpointer, CheckpointMeta, CheckpointSettings
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.store.checkpoints import Keys
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.settings import read_settings
from tests.checkpoint.conftest import Backend

JOB = "trust-job"
OTHER = "other-job"
IGNORED = "ignoring the ojs_last_checkpoint header of trust-job: it "


def _resume(
    backend: Backend, store: OJSStore, header: Any, **settings: Any
) -> CheckpointMeta | None:
    return Checkpointer(JOB, backend.settings(**settings), store, header_last=header).resume()


def test_a_header_pointing_at_another_path_is_ignored_and_the_job_starts_over_section_15_3(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    """§15.3: workers MUST NOT restore checkpoints from untrusted sources."""
    own = f"{file_backend.storage_uri}{JOB}/"
    with caplog.at_level(logging.WARNING):
        assert _resume(file_backend, store, {"epoch": 5, "storage_key": "file:///etc/"}) is None

    assert (
        f"{IGNORED}has storage_key 'file:///etc/' outside this job's checkpoint directory "
        f"'{own}' (OJS ML §15.3)" in caplog.text
    )
    assert "trust-job has no valid checkpoint; starting from the beginning" in caplog.text


def test_a_header_naming_another_jobs_committed_checkpoint_is_ignored_section_15_3(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    """§15.3: a job never restores another job's checkpoint, even a committed one."""
    theirs = Checkpointer(OTHER, file_backend.settings(), store).save(epoch=8)

    with caplog.at_level(logging.WARNING):
        assert _resume(file_backend, store, theirs.to_dict()) is None

    assert f"{IGNORED}belongs to job 'other-job', not 'trust-job' (OJS ML §15.3)" in caplog.text


def test_a_header_in_the_jobs_own_directory_but_never_committed_is_ignored_section_15_3(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    """§15.3 with §9.2: an uncommitted checkpoint is treated as non-existent."""
    key = f"{file_backend.storage_uri}{JOB}/9/"

    with caplog.at_level(logging.WARNING):
        assert _resume(file_backend, store, {"epoch": 9, "storage_key": key}) is None

    assert (
        f"{IGNORED}is not a committed checkpoint of trust-job in the store (OJS ML §15.3); "
        'set app.conf.ojs_ml_checkpoint_restore = "own_directory" to trust headers'
    ) in caplog.text


def test_a_forged_header_does_not_displace_the_committed_checkpoint_section_15_3(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    """§15.3: the store's committed record wins; the forged header is reported."""
    saved = Checkpointer(JOB, file_backend.settings(), store).save(epoch=3)

    with caplog.at_level(logging.WARNING):
        resumed = _resume(file_backend, store, {"epoch": 99, "storage_key": "file:///etc/"})

    assert resumed == saved
    assert f"{IGNORED}has storage_key 'file:///etc/' outside" in caplog.text


def test_the_header_a_worker_republishes_matches_the_committed_record_and_is_silent(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    saved = Checkpointer(JOB, file_backend.settings(), store).save(epoch=3)

    with caplog.at_level(logging.WARNING):
        assert _resume(file_backend, store, saved.to_dict()) == saved

    assert caplog.text == ""


def test_an_older_retained_checkpoint_in_the_header_is_trusted_but_the_newest_wins(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    first = Checkpointer(JOB, file_backend.settings(), store).save(epoch=1)
    second = Checkpointer(JOB, file_backend.settings(), store).save(epoch=2)

    with caplog.at_level(logging.WARNING):
        assert _resume(file_backend, store, first.to_dict()) == second

    assert caplog.text == ""


def test_a_committed_record_of_another_job_is_not_restored_section_15_3(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    """§15.3: even the store's record is checked (a hand-edited or restored store)."""
    theirs = CheckpointMeta(job_id=OTHER, epoch=4, storage_key=f"{file_backend.storage_uri}x/")
    store.client.set(Keys.of(store, JOB).last, theirs.to_json())

    with caplog.at_level(logging.WARNING):
        assert _resume(file_backend, store, None) is None

    assert (
        "ignoring the committed checkpoint of trust-job in the store: it belongs to job "
        "'other-job', not 'trust-job' (OJS ML §15.3)"
    ) in caplog.text


def test_a_corrupt_committed_record_is_ignored_with_a_warning_not_a_crash_section_9_3(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    store.client.set(Keys.of(store, JOB).last, "not json")

    with caplog.at_level(logging.WARNING):
        assert _resume(file_backend, store, None) is None

    assert "ignoring the committed checkpoint of trust-job in the store: it cannot be read" in (
        caplog.text
    )


def test_own_directory_mode_restores_an_uncommitted_header_in_the_jobs_own_directory(
    file_backend: Backend, store: OJSStore
) -> None:
    """v0.1 §4.4 resume semantics for a store that lost its records, when the operator opts in."""
    key = f"{file_backend.storage_uri}{JOB}/9/"
    header = {"epoch": 9, "storage_key": key}

    resumed = _resume(file_backend, store, header, restore="own_directory")

    assert resumed == CheckpointMeta(job_id=JOB, epoch=9, storage_key=key)


@pytest.mark.parametrize(
    ("key", "job_id", "reason"),
    [
        ("file:///etc/", None, "has storage_key 'file:///etc/' outside this job's checkpoint"),
        ("{own}other-job/1/", OTHER, "belongs to job 'other-job', not 'trust-job'"),
        ("{own}other-job/1/", None, "has storage_key '{own}other-job/1/' outside this job's"),
    ],
)
def test_own_directory_mode_still_refuses_other_jobs_and_other_paths_section_15_3(
    key: str,
    job_id: str | None,
    reason: str,
    file_backend: Backend,
    store: OJSStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """§15.3: opting in trusts only this job's own directory, never another job's."""
    own = file_backend.storage_uri
    header = {"epoch": 1, "storage_key": key.format(own=own)}
    if job_id is not None:
        header["job_id"] = job_id

    with caplog.at_level(logging.WARNING):
        assert _resume(file_backend, store, header, restore="own_directory") is None

    assert IGNORED + reason.format(own=own) in caplog.text


def test_a_job_without_a_storage_uri_restores_no_header(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture
) -> None:
    header = {"epoch": 1, "storage_key": f"{file_backend.storage_uri}{JOB}/1/"}
    ckpt = Checkpointer(JOB, CheckpointSettings(restore="own_directory"), store, header_last=header)

    with caplog.at_level(logging.WARNING):
        assert ckpt.resume() is None

    assert f"{IGNORED}has storage_key" in caplog.text
    assert "no ext_ml_checkpoint_storage_uri" in caplog.text


def test_a_resume_from_file_uri_outside_the_artifact_prefixes_is_ignored_extensions_12_1(
    file_backend: Backend, store: OJSStore, caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    """Extensions §12.1: no arbitrary file system access, on the task side too."""
    uri = f"file://{tmp_path}/pretrained.pt"
    ckpt = Checkpointer(JOB, file_backend.settings(), store, resume_from=uri)

    with caplog.at_level(logging.WARNING):
        assert ckpt.resume() is None

    assert f"ignoring ext_mlx_training_resume_from: it has storage_key {uri!r} that " in (
        caplog.text
    )
    assert "is not under an allowed prefix" in caplog.text


def test_the_restore_setting_rejects_an_unknown_mode_listing_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="'committed' or 'own_directory'"):
        read_settings({"ojs_ml_checkpoint_restore": "anything"})


def test_the_restore_setting_defaults_to_committed() -> None:
    assert read_settings({}).checkpoint_restore == "committed"
    assert CheckpointSettings().restore == "committed"
