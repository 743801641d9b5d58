"""Checkpoint storage URIs follow the artifact reach rule (OJS ML Extensions §12.1, OJS ML §15.3).

Extensions §12.1: URIs MUST NOT allow arbitrary file system access. §15.3: checkpoint
storage URIs MUST be validated against an allow-list of permitted prefixes. A
`file://` checkpoint directory or an internal host is refused unless an
`ojs_ml_checkpoint_prefixes` entry grants it, as `ojs_ml_artifact_prefixes` does
for artifact URIs.
"""

from __future__ import annotations

import pytest

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.bounds import DEFAULT_BOUNDS, Bounds
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.uris import checkpoint_problems

ATTR = "ext_ml_checkpoint_storage_uri"


def _refusal(uri: str, bounds: Bounds = DEFAULT_BOUNDS) -> str:
    with pytest.raises(SpecError) as found:
        normalize({ATTR: uri}, bounds)
    return str(found.value)


def test_a_file_checkpoint_uri_is_refused_by_default_naming_the_attribute_and_setting_12_1() -> (
    None
):
    assert _refusal("file:///etc/cron.d/") == (
        "ext_ml_checkpoint_storage_uri 'file:///etc/cron.d/' is not under an allowed prefix "
        "(OJS ML §15.3, Extensions §12.1); use an object-store URI, e.g. "
        '"s3://bucket/checkpoints/run-1/", or allow it with '
        'app.conf.ojs_ml_checkpoint_prefixes = ["file:///mnt/nfs/checkpoints/"] '
        "(every checkpoint storage URI must then be under a listed prefix)"
    )


def test_the_default_bounds_keep_the_file_scheme_but_grant_no_prefix_section_15_3() -> None:
    """Safe by default: `file` stays an allowed scheme (§9.4), reachable only by a grant."""
    assert "file" in DEFAULT_BOUNDS.checkpoint_schemes
    assert DEFAULT_BOUNDS.checkpoint_prefixes == ()


def test_a_checkpoint_uri_on_an_internal_host_is_refused_with_the_grant_that_allows_it_12_1() -> (
    None
):
    assert _refusal("gs://10.0.0.5/ckpt/") == (
        "ext_ml_checkpoint_storage_uri 'gs://10.0.0.5/ckpt/' points at an internal address "
        "'10.0.0.5' (SSRF) (OJS ML §15.3, Extensions §12.1); use a public storage URI, e.g. "
        '"s3://bucket/checkpoints/run-1/", or allow it with '
        'app.conf.ojs_ml_checkpoint_prefixes = ["gs://10.0.0.5/"] '
        "(every checkpoint storage URI must then be under a listed prefix)"
    )


@pytest.mark.parametrize(
    "uri", ["file:///mnt/nfs/checkpoints/run-1/", "file://localhost/mnt/nfs/checkpoints/a/"]
)
def test_a_file_checkpoint_uri_under_a_granted_prefix_is_accepted_section_15_3(uri: str) -> None:
    bounds = Bounds(
        checkpoint_prefixes=("file:///mnt/nfs/checkpoints/", "file://localhost/mnt/nfs/")
    )
    assert normalize({ATTR: uri}, bounds).flat()[ATTR] == uri


def test_a_granted_prefix_matches_whole_path_segments_only_extensions_12_1() -> None:
    bounds = Bounds(checkpoint_prefixes=("file:///mnt/ckpt",))
    normalize({ATTR: "file:///mnt/ckpt/run/"}, bounds)
    assert "is outside the allowed prefixes ['file:///mnt/ckpt']" in _refusal(
        "file:///mnt/ckpt-evil/run/", bounds
    )


def test_a_prefix_may_grant_an_internal_host_as_for_artifact_uris_extensions_12_1() -> None:
    bounds = Bounds(checkpoint_prefixes=("s3://10.0.0.5/",))
    assert normalize({ATTR: "s3://10.0.0.5/ckpt/"}, bounds).flat()[ATTR] == "s3://10.0.0.5/ckpt/"


def test_traversal_out_of_a_granted_prefix_is_still_refused_section_15_3() -> None:
    bounds = Bounds(checkpoint_prefixes=("file:///mnt/ckpt/",))
    assert "path traversal" in _refusal("file:///mnt/ckpt/../../etc/cron.d/", bounds)


def test_with_prefixes_set_an_object_store_uri_outside_them_is_refused_section_15_3() -> None:
    bounds = Bounds(checkpoint_prefixes=("file:///mnt/ckpt/",))
    text = _refusal("s3://anywhere/ckpt/", bounds)
    assert "'s3://anywhere/ckpt/' is outside the allowed prefixes ['file:///mnt/ckpt/']" in text
    assert "or add its prefix to app.conf.ojs_ml_checkpoint_prefixes" in text


def test_an_object_store_checkpoint_uri_needs_no_grant_section_9_4() -> None:
    assert list(checkpoint_problems("s3://bucket/ckpt/", DEFAULT_BOUNDS.checkpoint_schemes)) == []


def test_a_refusal_rebuilt_from_its_message_by_a_result_backend_reads_the_same() -> None:
    """Celery rebuilds a task's exception from its message: `task.get()` shows the refusal."""
    with pytest.raises(SpecError) as found:
        normalize({ATTR: "file:///etc/cron.d/"})
    rebuilt = SpecError(str(found.value))
    assert str(rebuilt) == str(found.value) and rebuilt.violations == []
