"""Where artifact URIs may point (OJS ML Extensions §12.1), and the settings that widen it.

§12.1: backends MUST validate that artifact URIs use allowed schemes and MUST
NOT allow arbitrary file system access; they SHOULD enforce prefix allow-lists.
Every `ext_mlx_*` URI attribute follows the same rules, on every path that
validates a job (`validate_mlx`, `parse_job` with the app's bounds).
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.envelope import ParseOptions, parse_job
from celery_ojs_ml.spec.mlx import KNOWN_ATTRIBUTES, validate_mlx
from celery_ojs_ml.spec.normalize import DEFAULT_BOUNDS, Bounds

URI_ATTRIBUTES = sorted(
    a for a in KNOWN_ATTRIBUTES if a.endswith("_uri") or a.endswith(("_resume_from", "_locality"))
)
DATA = ("file:///data/artifacts/",)


def violations_of(attrs: dict[str, Any], **kwargs: Any) -> list[str]:
    with pytest.raises(SpecError) as info:
        validate_mlx(attrs, **kwargs)
    return [str(v) for v in info.value.violations]


def test_a_file_uri_is_refused_by_default_naming_the_setting_that_allows_it() -> None:
    """§12.1: backends MUST NOT allow arbitrary file system access."""
    assert violations_of({"ext_mlx_artifact_model_uri": "file:///etc/shadow"}) == [
        "ext_mlx_artifact_model_uri 'file:///etc/shadow' is not under an allowed prefix "
        "(OJS ML Extensions §12.1); use an object-store URI, e.g. "
        '"s3://bucket/models/v1.0/model.safetensors", or allow it with '
        'app.conf.ojs_ml_artifact_prefixes = ["file:///data/artifacts/"] '
        "(every artifact URI must then be under a listed prefix)"
    ]


@pytest.mark.parametrize("attribute", URI_ATTRIBUTES)
def test_every_uri_attribute_refuses_a_file_uri_outside_the_allowed_prefixes(
    attribute: str,
) -> None:
    """§12.1: backends MUST NOT allow arbitrary file system access."""
    with pytest.raises(SpecError) as info:
        validate_mlx({attribute: "file:///home/alice/.ssh/id_rsa"})
    assert info.value.paths == [attribute]


@pytest.mark.parametrize(
    "uri",
    [
        "hdfs://127.0.0.1/x",
        "hdfs://localhost:8020/x",
        "hdfs://[::1]/x",
        "hdfs://169.254.169.254/latest/meta-data/",
        "hdfs://192.168.0.4:8020/models/",
        "s3://10.1.2.3/bucket/model.bin",
        "mlflow://0.0.0.0/run/artifacts/model",
        "gs://metadata.google.internal/computeMetadata/v1/",
    ],
)
def test_network_uris_to_loopback_link_local_or_private_hosts_are_refused_by_default(
    uri: str,
) -> None:
    """§12.1 with OJS ML §15.2: URIs must not reach internal services (SSRF)."""
    with pytest.raises(SpecError) as info:
        validate_mlx({"ext_mlx_artifact_dataset_uri": uri})
    [violation] = info.value.violations
    assert violation.path == "ext_mlx_artifact_dataset_uri"
    assert violation.section == "OJS ML Extensions §12.1"
    assert "points at an internal address" in violation.problem


def test_an_internal_host_reads_as_a_teaching_message_with_the_prefix_that_allows_it() -> None:
    """§12.1: the refusal names the setting that allows a trusted internal cluster."""
    assert violations_of({"ext_mlx_artifact_dataset_uri": "hdfs://127.0.0.1/x"}) == [
        "ext_mlx_artifact_dataset_uri 'hdfs://127.0.0.1/x' points at an internal address "
        "'127.0.0.1' (SSRF) (OJS ML Extensions §12.1); use a public storage URI, e.g. "
        '"s3://bucket/models/v1.0/model.safetensors", or allow it with '
        'app.conf.ojs_ml_artifact_prefixes = ["hdfs://127.0.0.1/"] '
        "(every artifact URI must then be under a listed prefix)"
    ]


@pytest.mark.parametrize(
    "uri",
    [
        "file:///data/artifacts/model.bin",
        "file://localhost/data/artifacts/v1/",
        "hdfs://10.0.0.5/m",
    ],
)
def test_a_uri_under_an_allowed_prefix_passes_even_on_file_or_an_internal_host(uri: str) -> None:
    """§12.1: backends SHOULD enforce allow-lists of permitted URI prefixes."""
    prefixes = (*DATA, "file://localhost/data/artifacts/", "hdfs://10.0.0.5/")
    attrs = {"ext_mlx_artifact_model_uri": uri}
    assert validate_mlx(attrs, uri_prefixes=prefixes) == (attrs, [])


def test_with_prefixes_set_every_artifact_uri_must_start_with_one_of_them() -> None:
    """§12.1: backends SHOULD enforce allow-lists of permitted URI prefixes."""
    attrs = {"ext_mlx_inference_model_uri": "s3://other-team/model.bin"}
    assert violations_of(attrs, uri_prefixes=("s3://models/", *DATA)) == [
        "ext_mlx_inference_model_uri 's3://other-team/model.bin' is not under an allowed "
        "prefix (OJS ML Extensions §12.1); use a URI under one of "
        "['s3://models/', 'file:///data/artifacts/'], or add its prefix to "
        "app.conf.ojs_ml_artifact_prefixes"
    ]


@pytest.mark.parametrize(
    ("prefix", "uri"),
    [
        ("file:///data/artifacts", "file:///data/artifacts-evil/model.bin"),
        ("s3://models", "s3://models-evil/model.bin"),
    ],
)
def test_a_prefix_matches_whole_path_segments_only(prefix: str, uri: str) -> None:
    """§12.1: `file:///data/artifacts` does not admit `file:///data/artifacts-evil/`."""
    with pytest.raises(SpecError, match="is not under an allowed prefix"):
        validate_mlx({"ext_mlx_artifact_model_uri": uri}, uri_prefixes=(prefix,))


def test_a_prefix_without_a_trailing_slash_admits_what_lies_beneath_it() -> None:
    attrs = {"ext_mlx_artifact_model_uri": "s3://models/v1/model.bin"}
    assert validate_mlx(attrs, uri_prefixes=("s3://models",))[0] == attrs


@pytest.mark.parametrize(
    "uri", ["file:///data/artifacts/../../etc/shadow", "file:///data/artifacts/%2e%2e/etc/shadow"]
)
def test_traversal_out_of_an_allowed_prefix_is_still_refused(uri: str) -> None:
    """§12.1: an allowed prefix never admits a '..' segment."""
    with pytest.raises(SpecError, match="path traversal"):
        validate_mlx({"ext_mlx_artifact_model_uri": uri}, uri_prefixes=DATA)


def test_a_scheme_outside_the_allow_list_names_the_setting_that_allows_it() -> None:
    """§12.1: backends MUST validate that artifact URIs use allowed schemes."""
    assert violations_of(
        {"ext_mlx_artifact_model_uri": "hf://org/model"}, uri_schemes=frozenset({"s3"})
    ) == [
        'ext_mlx_artifact_model_uri uses scheme "hf", which is not allowed (allowed: s3) '
        "(OJS ML Extensions §12.1); use an allowed scheme, e.g. "
        '"s3://bucket/models/v1.0/model.safetensors", or add it to '
        "app.conf.ojs_ml_artifact_schemes"
    ]


# -- the bounds carry the settings to every path that parses a job ---------------------------


def _job(uri: str) -> dict[str, Any]:
    return {"type": "ml.train", "ext_ml_gpu_count": 1, "ext_mlx_artifact_model_uri": uri}


def test_the_default_bounds_allow_the_well_known_schemes_and_no_prefix() -> None:
    assert DEFAULT_BOUNDS.artifact_schemes == frozenset(
        {"s3", "gs", "az", "hdfs", "mlflow", "wandb", "hf", "file"}
    )
    assert DEFAULT_BOUNDS.artifact_prefixes == ()


def test_parse_job_refuses_a_file_artifact_uri_with_the_default_bounds() -> None:
    """§12.1: backends MUST NOT allow arbitrary file system access."""
    with pytest.raises(SpecError) as info:
        parse_job(_job("file:///etc/shadow"))
    assert info.value.paths == ["ext_mlx_artifact_model_uri"]


def test_parse_job_narrows_the_schemes_with_the_bounds_artifact_schemes() -> None:
    """§12.1: backends SHOULD narrow the allow-list per queue or tenant."""
    options = ParseOptions(bounds=Bounds(artifact_schemes=frozenset({"s3"})))
    with pytest.raises(SpecError, match='uses scheme "hf", which is not allowed'):
        parse_job(_job("hf://org/model"), options)


def test_parse_job_admits_a_file_uri_under_the_bounds_artifact_prefixes() -> None:
    options = ParseOptions(bounds=Bounds(artifact_prefixes=DATA))
    job = parse_job(_job("file:///data/artifacts/model.bin"), options)
    assert job.mlx == {"ext_mlx_artifact_model_uri": "file:///data/artifacts/model.bin"}
