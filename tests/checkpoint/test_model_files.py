"""Model files (OJS ML §4, §5.3): checksum verification and resolution, on `file://` and
on S3 through moto's real server."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import fsspec
import pytest

from celery_ojs_ml.child.model_files import ChecksumMismatch, resolve, trim, verify
from tests.checkpoint.conftest import s3_options

WEIGHTS = b"weights" * 1000
GOOD = "sha256:" + hashlib.sha256(WEIGHTS).hexdigest()
BAD = "sha256:" + "0" * 64


def test_a_matching_checksum_passes_and_a_mismatch_names_the_attribute_and_both_digests(
    tmp_path: Path,
) -> None:
    """§4 MUST: a mismatch rejects the job with a descriptive error."""
    f = tmp_path / "model.bin"
    f.write_bytes(WEIGHTS)
    verify(f, GOOD)
    verify(f"file://{f}", GOOD)
    with pytest.raises(ChecksumMismatch) as found:
        verify(f, BAD)
    text = str(found.value)
    assert "ext_ml_model_checksum" in text and BAD in text and GOOD in text


def test_an_unknown_algorithm_is_a_value_error_naming_the_attribute(tmp_path: Path) -> None:
    f = tmp_path / "m"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="ext_ml_model_checksum"):
        verify(f, "crc99:abcd")


def test_resolve_fetches_a_file_uri_once_into_the_cache_and_verifies_it(tmp_path: Path) -> None:
    src = tmp_path / "registry" / "model.bin"
    src.parent.mkdir()
    src.write_bytes(WEIGHTS)
    cache = tmp_path / "cache"
    first = resolve(f"file://{src}", checksum=GOOD, cache_dir=cache)
    src.write_bytes(b"changed upstream")  # the cached copy is served from now on
    again = resolve(f"file://{src}", checksum=GOOD, cache_dir=cache)
    assert first == again and again.read_bytes() == WEIGHTS


def test_resolve_deletes_a_corrupt_copy_instead_of_serving_it(tmp_path: Path) -> None:
    src = tmp_path / "model.bin"
    src.write_bytes(b"tampered")
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumMismatch):
        resolve(f"file://{src}", checksum=GOOD, cache_dir=cache)
    assert [p for p in cache.iterdir() if p.is_file()] == []


def test_the_cache_keeps_under_its_size_bound_least_recently_used_first(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    for i, name in enumerate(("old", "mid", "new")):
        p = cache / name
        p.write_bytes(b"x" * 1024)
        os.utime(p, (1000 + i, 1000 + i))
    gone = trim(cache, max_gb=2048 / 1024**3)
    assert [p.name for p in gone] == ["old"]


def test_resolve_fetches_from_s3_through_moto(
    s3_endpoint: str, aws_env: None, tmp_path: Path
) -> None:
    options = s3_options(s3_endpoint)
    fs = fsspec.filesystem("s3", **options)
    bucket = f"models-{uuid.uuid4().hex[:10]}"
    fs.mkdir(bucket)
    with fs.open(f"{bucket}/m/1/model.bin", "wb") as fh:
        fh.write(WEIGHTS)
    local = resolve(f"s3://{bucket}/m/1/model.bin", checksum=GOOD, cache_dir=tmp_path, **options)
    assert local.read_bytes() == WEIGHTS
    with pytest.raises(ChecksumMismatch):
        verify(f"s3://{bucket}/m/1/model.bin", BAD, **options)
