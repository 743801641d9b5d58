"""`ext_ml_model_checksum` is verified automatically where a pool child loads a model
(OJS ML §4: a mismatch MUST reject the job; §5.3: verify the resolved model before
loading; §15.2; OJS ML Extensions §12.3), and each file is hashed once per child."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from celery_ojs_ml.child import model_files, models
from celery_ojs_ml.child.model_files import ChecksumMismatch, resolve, resolve_model, verify_cached
from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.normalize import normalize

WEIGHTS = b"weights" * 1000
GOOD = "sha256:" + hashlib.sha256(WEIGHTS).hexdigest()
BAD = "sha256:" + "0" * 64


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    models.clear()
    model_files.forget_digests()
    yield
    models.clear()
    model_files.forget_digests()


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    f = tmp_path / "model.safetensors"
    f.write_bytes(WEIGHTS)
    return f


def _task(**headers: Any) -> SimpleNamespace:
    settings = SimpleNamespace(model_cache_size=4, model_cache_vram_gb=None)
    plugin = SimpleNamespace(settings=settings)
    return SimpleNamespace(app=SimpleNamespace(ojs_ml=plugin), request=SimpleNamespace(**headers))


def _load(loads: list[str]) -> str:
    loads.append("x")
    return "net"


def _hashed() -> int:
    return model_files.digest_stats()["hashed"]


def test_model_verifies_the_jobs_checksum_before_the_loader_runs_section_4(weights: Path) -> None:
    loads: list[str] = []
    task = _task(ext_ml_model_checksum=GOOD)

    net = models.model(task, ("m", "1"), lambda: _load(loads), path=weights)

    assert (net, loads, _hashed()) == ("net", ["x"], 1)


def test_a_checksum_mismatch_fails_the_job_naming_the_attribute_and_both_digests_section_4(
    weights: Path,
) -> None:
    loads: list[str] = []
    task = _task(ext_ml_model_checksum=BAD)

    with pytest.raises(ChecksumMismatch) as found:
        models.model(task, ("m", "1"), lambda: _load(loads), path=weights)

    assert str(found.value) == (
        f"ext_ml_model_checksum mismatch for {weights}: expected {BAD}, got {GOOD}; the model "
        "is corrupt or was replaced (OJS ML §4), so the job is rejected"
    )
    assert loads == [] and models.loaded() == []


def test_a_cached_model_is_not_served_to_a_job_whose_checksum_its_file_fails_section_4(
    weights: Path,
) -> None:
    models.model(_task(ext_ml_model_checksum=GOOD), ("m", "1"), lambda: "net", path=weights)

    with pytest.raises(ChecksumMismatch, match="ext_ml_model_checksum mismatch"):
        models.model(_task(ext_ml_model_checksum=BAD), ("m", "1"), lambda: "net", path=weights)


def test_the_digest_is_computed_once_per_file_and_reused_by_later_jobs_section_4(
    weights: Path,
) -> None:
    for _ in range(5):
        models.model(_task(ext_ml_model_checksum=GOOD), ("m", "1"), lambda: "net", path=weights)

    assert model_files.digest_stats() == {"hashed": 1, "reused": 4}


def test_a_file_replaced_after_it_was_verified_is_hashed_again_and_fails_section_4(
    weights: Path,
) -> None:
    verify_cached(weights, GOOD)
    weights.write_bytes(b"tampered" * 1000)
    os.utime(weights, ns=(1, 1))  # a clock step cannot hide a rewrite: size and mtime differ

    with pytest.raises(ChecksumMismatch):
        verify_cached(weights, GOOD)
    assert _hashed() == 2


def test_without_path_model_verifies_the_jobs_inference_model_uri_extensions_12_3(
    weights: Path,
) -> None:
    task = _task(ext_ml_model_checksum=BAD, ext_mlx_inference_model_uri=f"file://{weights}")

    with pytest.raises(ChecksumMismatch, match=f"for file://{weights}"):
        models.model(task, ("m", "1"), lambda: "net")


def test_a_job_without_a_checksum_loads_without_reading_the_file(weights: Path) -> None:
    models.model(_task(), ("m", "1"), lambda: "net", path=weights)

    assert _hashed() == 0


def test_a_checksum_with_no_file_to_verify_is_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    task = _task(ext_ml_model_checksum=GOOD)
    for _ in range(3):
        models.model(task, ("m", "1"), lambda: "net")

    assert caplog.text.count("knows no file to verify; pass path=...") == 1


def test_eager_apply_headers_and_the_ml_option_give_the_checksum_too(weights: Path) -> None:
    eager = SimpleNamespace(request=SimpleNamespace(headers={"ext_ml_model_checksum": BAD}))
    declared = SimpleNamespace(request=SimpleNamespace(), ml={"ext_ml_model_checksum": BAD})
    for task in (eager, declared):
        with pytest.raises(ChecksumMismatch):
            model_files.verify_model(task, weights)


def test_resolve_model_fetches_the_jobs_model_once_and_verifies_it_section_5_3(
    weights: Path, tmp_path: Path
) -> None:
    task = _task(ext_ml_model_checksum=GOOD, ext_mlx_inference_model_uri=f"file://{weights}")
    cache = tmp_path / "cache"

    first = resolve_model(task, cache_dir=cache)
    again = resolve_model(task, cache_dir=cache)

    assert first == again and first.read_bytes() == WEIGHTS
    assert model_files.digest_stats() == {"hashed": 1, "reused": 1}


def test_resolve_model_refuses_a_copy_that_fails_the_jobs_checksum_section_5_3(
    weights: Path, tmp_path: Path
) -> None:
    task = _task(ext_ml_model_checksum=BAD)
    cache = tmp_path / "cache"

    with pytest.raises(ChecksumMismatch, match=f"expected {BAD}, got {GOOD}"):
        resolve_model(task, f"file://{weights}", cache_dir=cache)
    assert [p for p in cache.iterdir() if p.is_file()] == []


def test_resolving_keeps_the_cached_copys_identity_so_its_digest_is_reused(
    weights: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    for _ in range(3):
        resolve(f"file://{weights}", checksum=GOOD, cache_dir=cache)

    assert model_files.digest_stats() == {"hashed": 1, "reused": 2}


def test_resolve_model_without_a_model_uri_says_which_attribute_to_set() -> None:
    with pytest.raises(Exception, match="give the job ext_mlx_inference_model_uri"):
        resolve_model(_task(ext_ml_model_checksum=GOOD))


def test_a_blake3_checksum_is_refused_at_publish_naming_the_supported_algorithms_section_4() -> (
    None
):
    with pytest.raises(SpecError) as found:
        normalize({"ext_ml_model_checksum": "blake3:" + "0" * 64})

    assert str(found.value) == (
        "ext_ml_model_checksum uses algorithm 'blake3', which is not supported (Python's "
        "hashlib has no blake3, so no worker could verify it); supported: blake2b, blake2s, "
        'md5, sha1, sha224, sha256, sha384, sha512 (OJS ML §4); write "algorithm:hexdigest", '
        'e.g. "sha256:<64 hex digits>"'
    )


@pytest.mark.parametrize("algorithm", ["md5", "sha1", "sha224", "sha256", "sha384", "sha512",
                                       "blake2b", "blake2s"])  # fmt: skip
def test_every_algorithm_accepted_at_publish_can_be_verified_by_a_worker_section_4(
    algorithm: str, weights: Path
) -> None:
    expected = f"{algorithm}:{hashlib.new(algorithm, WEIGHTS).hexdigest()}"
    normalize({"ext_ml_model_checksum": expected})
    verify_cached(weights, expected)
