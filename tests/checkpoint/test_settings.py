"""Checkpoint settings (OJS ML §9.1, §9.4, §15.3) and storage options."""

from __future__ import annotations

import pytest

from celery_ojs_ml.checkpoint import (
    CheckpointError,
    CheckpointSettings,
    register_storage_options,
    storage_options_for,
)
from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.normalize import Bounds


def test_a_storage_uri_with_a_disallowed_scheme_names_the_attribute_and_fix_section_15_3() -> None:
    with pytest.raises(SpecError) as info:
        CheckpointSettings(storage_uri="http://example.com/ckpt/")

    assert info.value.paths == ["ext_ml_checkpoint_storage_uri"]
    assert str(info.value) == (
        "ext_ml_checkpoint_storage_uri uses 'http'; allowed schemes are az, file, gs, s3 "
        "(OJS ML §15.3); use an allowed scheme, no '..', and a trailing slash, e.g. "
        '"s3://bucket/checkpoints/"'
    )


def test_a_storage_uri_outside_the_configured_prefixes_is_refused_section_15_3() -> None:
    bounds = Bounds(checkpoint_prefixes=("s3://team-a/",))

    with pytest.raises(SpecError, match=r"is outside the allowed prefixes \['s3://team-a/'\]"):
        CheckpointSettings(storage_uri="s3://team-b/ckpt/", bounds=bounds)


def test_a_missing_trailing_slash_is_added_section_9_4() -> None:
    settings = CheckpointSettings(storage_uri="s3://bucket/checkpoints")

    assert settings.storage_uri == "s3://bucket/checkpoints/"


def test_settings_from_attributes_take_the_spec_defaults_section_9_1() -> None:
    settings = CheckpointSettings.from_attrs(
        {
            "ext_ml_checkpoint_enabled": True,
            "ext_ml_checkpoint_storage_uri": "s3://bucket/ckpt",
            "ext_ml_gpu_count": 1,
        }
    )

    assert (settings.storage_uri, settings.enabled) == ("s3://bucket/ckpt/", True)
    assert (settings.interval_s, settings.max_count) == (300, 3)
    assert (settings.on_preempt, settings.grace_period_s) == (False, 30)


def test_settings_from_attributes_keep_what_the_job_asked_for() -> None:
    settings = CheckpointSettings.from_attrs(
        {
            "ext_ml_checkpoint_enabled": True,
            "ext_ml_checkpoint_interval_s": 60,
            "ext_ml_checkpoint_storage_uri": "file:///mnt/nfs/ckpt/",
            "ext_ml_checkpoint_max_count": 5,
            "ext_ml_checkpoint_on_preempt": True,
            "ext_ml_preemption_grace_period_s": 120,
        },
        bounds=Bounds(checkpoint_prefixes=("file:///mnt/nfs/",)),
    )

    assert (settings.interval_s, settings.max_count) == (60, 5)
    assert (settings.on_preempt, settings.grace_period_s) == (True, 120)


def test_an_invalid_interval_from_attributes_fails_with_the_validators_message() -> None:
    with pytest.raises(SpecError) as info:
        CheckpointSettings.from_attrs({"ext_ml_checkpoint_interval_s": 0})

    assert info.value.paths == ["ext_ml_checkpoint_interval_s"]


def test_storage_options_come_from_the_longest_matching_prefix() -> None:
    conf = {
        "ojs_ml_checkpoint_storage_options": {
            "s3": {"client_kwargs": {"endpoint_url": "https://minio.internal:9000"}},
            "s3://archive/": {"anon": True},
        }
    }

    assert storage_options_for("s3://archive/ckpt/", conf) == {"anon": True}
    assert storage_options_for("s3://bucket/ckpt/", conf) == {
        "client_kwargs": {"endpoint_url": "https://minio.internal:9000"}
    }
    assert storage_options_for("gs://bucket/ckpt/", conf) == {}


def test_the_celery_setting_wins_over_a_registered_entry_with_the_same_prefix() -> None:
    register_storage_options("s3://", profile="registered")
    register_storage_options("gs", project="registered")
    conf = {"ojs_ml_checkpoint_storage_options": {"s3://": {"profile": "setting"}}}

    assert storage_options_for("s3://b/", conf) == {"profile": "setting"}
    assert storage_options_for("gs://b/", conf) == {"project": "registered"}


def test_a_malformed_storage_options_setting_shows_a_correct_example() -> None:
    conf = {"ojs_ml_checkpoint_storage_options": {"s3://": "http://minio:9000"}}

    with pytest.raises(CheckpointError) as info:
        storage_options_for("s3://b/", conf)

    assert str(info.value).startswith(
        "ojs_ml_checkpoint_storage_options must map URI prefixes to fsspec options, e.g. "
        '{"s3://": {"client_kwargs": {"endpoint_url": "https://minio.internal:9000"}}}'
    )
