"""Model files (OJS ML §4, §5.3): checksum verification and resolution into a local cache.

    path = resolve(self.request.ext_ml_model_registry_uri, checksum=...)   # fetched once
    verify(path, "sha256:e3b0...")   # raises ChecksumMismatch naming ext_ml_model_checksum

Key decisions: files are streamed through fsspec (any of its schemes) in 8 MiB
chunks, so a 140 GB checkpoint is hashed without being read into memory, and a
mismatch is a terminal task failure (§4 MUST reject). A corrupt copy is deleted,
never served; concurrent children fetch into a temporary name and rename, so a
reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from celery_ojs_ml.errors import OJSMLError

_CHUNK = 8 * 1024 * 1024
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "ojs-ml-models"


class ChecksumMismatch(OJSMLError):
    """The model's bytes are not what `ext_ml_model_checksum` says (§4: reject the job)."""


def _parse(expected: str) -> tuple[str, str]:
    algo, _, digest = str(expected).partition(":")
    if not digest or algo.lower() not in hashlib.algorithms_available:
        raise ValueError(
            f"ext_ml_model_checksum is {expected!r}; use algorithm:hexdigest with an algorithm "
            f"hashlib knows, e.g. 'sha256:e3b0c442...'"
        )
    return algo.lower(), digest.lower()


def digest_of(path_or_uri: str, algo: str = "sha256", **storage_options: Any) -> str:
    """The hex digest of a file or URI, streamed."""
    import fsspec

    h = hashlib.new(algo)
    with fsspec.open(str(path_or_uri), "rb", **storage_options) as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify(path_or_uri: str | Path, expected: str, **storage_options: Any) -> None:
    """Raise `ChecksumMismatch` unless the file's digest is `expected` (`algo:hex`)."""
    algo, want = _parse(expected)
    got = digest_of(str(path_or_uri), algo, **storage_options)
    if got != want:
        raise ChecksumMismatch(
            f"ext_ml_model_checksum mismatch for {path_or_uri}: expected {algo}:{want}, "
            f"got {algo}:{got}; the model is corrupt or was replaced (OJS ML §4), so the "
            "job is rejected"
        )


def verify_model(task: Any, path_or_uri: str | Path, **storage_options: Any) -> None:
    """In a task: verify a model file against the job's own `ext_ml_model_checksum` (§4)."""
    expected = getattr(getattr(task, "request", None), "ext_ml_model_checksum", None)
    if expected:
        verify(path_or_uri, str(expected), **storage_options)


def resolve(
    uri: str,
    *,
    checksum: str | None = None,
    cache_dir: str | Path = DEFAULT_CACHE,
    max_cache_gb: float = 100.0,
    **storage_options: Any,
) -> Path:
    """A local copy of `uri` (fetched once, verified when `checksum` is given).

    Whatever fsspec can open (`s3://`, `gs://`, `file://`, `hf://` when huggingface_hub
    is installed) is copied into `cache_dir`, keyed by the URI; the cache is kept under
    `max_cache_gb` by deleting the least recently used files (`trim`).
    """
    import fsspec

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(uri.encode()).hexdigest()[:32] + "-" + Path(uri.rstrip("/")).name[-64:]
    local = cache / name
    if not local.exists():
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=".fetch-")
        try:
            with os.fdopen(fd, "wb") as out, fsspec.open(uri, "rb", **storage_options) as src:
                shutil.copyfileobj(src, out, _CHUNK)
            os.replace(tmp, local)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    if checksum is not None:
        try:
            verify(local, checksum)
        except ChecksumMismatch:
            local.unlink(missing_ok=True)
            raise
    os.utime(local)  # most recently used
    trim(cache, max_cache_gb, keep=local)
    return local


def trim(cache: Path, max_gb: float, keep: Path | None = None) -> list[Path]:
    """Delete least recently used files until the cache holds at most `max_gb`."""
    files = sorted(
        (p for p in cache.iterdir() if p.is_file() and not p.name.startswith(".fetch-")),
        key=lambda p: p.stat().st_mtime,
    )
    total = sum(p.stat().st_size for p in files)
    gone = []
    for p in files:
        if total <= max_gb * 1024**3:
            break
        if p == keep:
            continue
        total -= p.stat().st_size
        p.unlink(missing_ok=True)
        gone.append(p)
    return gone
