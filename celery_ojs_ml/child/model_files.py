"""Model files (OJS ML §4, §5.3): checksum verification and resolution into a local cache.

    path = resolve_model(self)   # the job's model URI, fetched once, verified (§5.3)
    verify(path, "sha256:e3b0...")   # raises ChecksumMismatch naming ext_ml_model_checksum

Key decisions: files are streamed through fsspec (any of its schemes) in 8 MiB
chunks, so a 140 GB checkpoint is hashed without being read into memory, and a
mismatch is a terminal task failure (§4 MUST reject). A pool child hashes a file
once per algorithm: the digest is kept keyed by the file's identity (path, size,
mtime, inode; `verify_cached`), so a warm child serving many jobs with the same
checksum stats the file instead of reading it again. A corrupt copy is deleted,
never served; concurrent children fetch into a temporary name and rename, so a
reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from celery_ojs_ml.errors import OJSMLError
from celery_ojs_ml.lru import LRU
from celery_ojs_ml.spec.rules import CHECKSUM_HEX_DIGITS

_CHUNK = 8 * 1024 * 1024
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "ojs-ml-models"
CHECKSUM = "ext_ml_model_checksum"
MODEL_URIS = ("ext_mlx_inference_model_uri", "ext_mlx_artifact_model_uri")
"""Where a job names its model file when the task does not (OJS ML Extensions §12.3)."""
_DIGESTS: LRU[tuple[Any, ...], str] = LRU(256)
"""This process's digests: (file identity, algorithm) -> hex digest (`verify_cached`)."""
_STATS = {"hashed": 0, "reused": 0}


class ChecksumMismatch(OJSMLError):
    """The model's bytes are not what `ext_ml_model_checksum` says (§4: reject the job)."""


def _parse(expected: str) -> tuple[str, str]:
    algo, _, digest = str(expected).partition(":")
    if not digest or algo.lower() not in CHECKSUM_HEX_DIGITS:
        raise ValueError(
            f"ext_ml_model_checksum is {expected!r}; use algorithm:hexdigest with one of "
            f"{', '.join(sorted(CHECKSUM_HEX_DIGITS))}, e.g. 'sha256:e3b0c442...'"
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
    _judge(path_or_uri, algo, want, digest_of(str(path_or_uri), algo, **storage_options))


def _judge(path_or_uri: str | Path, algo: str, want: str, got: str) -> None:
    if got != want:
        raise ChecksumMismatch(
            f"ext_ml_model_checksum mismatch for {path_or_uri}: expected {algo}:{want}, "
            f"got {algo}:{got}; the model is corrupt or was replaced (OJS ML §4), so the "
            "job is rejected"
        )


def verify_cached(path_or_uri: str | Path, expected: str, **storage_options: Any) -> None:
    """`verify`, hashing the file only the first time this process sees it as it is now.

    The digest is remembered under the file's identity (path, size, mtime, inode;
    for a remote URI what fsspec reports: size and its modification time or ETag),
    so a replaced or rewritten file is hashed again. A file whose identity is
    unknown, or that changed while it was hashed, is never remembered.
    """
    algo, want = _parse(expected)
    uri = str(path_or_uri)
    before = _identity(uri, storage_options)
    key = None if before is None else (*before, algo)
    got = None if key is None else _DIGESTS.get(key)
    if got is None:
        got = digest_of(uri, algo, **storage_options)
        _STATS["hashed"] += 1
        if key is not None and _identity(uri, storage_options) == before:
            _DIGESTS[key] = got
    else:
        _STATS["reused"] += 1
    _judge(path_or_uri, algo, want, got)


def _identity(uri: str, storage_options: Mapping[str, Any]) -> tuple[Any, ...] | None:
    local = uri if "://" not in uri else urlsplit(uri).path if uri.startswith("file:") else None
    try:
        if local is not None:
            st = os.stat(local)
            return (os.path.realpath(local), st.st_size, st.st_mtime_ns, st.st_ino)
        import fsspec

        fs, path = fsspec.core.url_to_fs(uri, **storage_options)
        info = fs.info(path)
    except (OSError, ValueError):
        return None
    stamp = next((info[k] for k in ("mtime", "LastModified", "ETag", "etag") if info.get(k)), None)
    return None if stamp is None else (uri, info.get("size"), str(stamp))


def digest_stats() -> dict[str, int]:
    """Files hashed and digests reused by `verify_cached` in this process (tests)."""
    return dict(_STATS)


def forget_digests() -> None:
    """Forget every remembered digest and zero `digest_stats` (tests)."""
    _DIGESTS.clear()
    _STATS.update(hashed=0, reused=0)


def job_value(task: Any, name: str) -> Any:
    """A job attribute as the running task sees it: the message's header (a request
    attribute, or `request.headers` under eager `apply()`), else the task's `ml=` option."""
    request = getattr(task, "request", None)
    value = getattr(request, name, None)
    if value is None:
        headers = getattr(request, "headers", None)
        value = headers.get(name) if isinstance(headers, Mapping) else None
    if value is None:
        ml = getattr(task, "ml", None)
        value = ml.get(name) if isinstance(ml, Mapping) else None
    return value


def job_model_file(task: Any) -> str | None:
    """The model file the job names (`ext_mlx_inference_model_uri`, then
    `ext_mlx_artifact_model_uri`; OJS ML Extensions §12.3), if any."""
    found = (job_value(task, name) for name in MODEL_URIS)
    return next((str(v) for v in found if isinstance(v, str) and v), None)


def verify_model(task: Any, path_or_uri: str | Path, **storage_options: Any) -> None:
    """In a task: verify a model file against the job's own `ext_ml_model_checksum` (§4)."""
    expected = job_value(task, CHECKSUM)
    if expected:
        verify_cached(path_or_uri, str(expected), **storage_options)


def resolve_model(
    task: Any,
    uri: str | None = None,
    *,
    cache_dir: str | Path = DEFAULT_CACHE,
    max_cache_gb: float = 100.0,
    **storage_options: Any,
) -> Path:
    """In a task: a local copy of the job's model file, verified against the job's
    `ext_ml_model_checksum` before it is returned (OJS ML §5.3 MUST).

    `uri` defaults to the file the job names (`job_model_file`)."""
    uri = uri or job_model_file(task)
    if not uri:
        raise OJSMLError(
            "resolve_model() needs a model file: pass its URI, or give the job "
            f'{MODEL_URIS[0]}, e.g. "s3://bucket/models/v1/model.safetensors"'
        )
    checksum = job_value(task, CHECKSUM)
    return resolve(
        uri,
        checksum=str(checksum) if checksum else None,
        cache_dir=cache_dir,
        max_cache_gb=max_cache_gb,
        **storage_options,
    )


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
            verify_cached(local, checksum)
        except ChecksumMismatch:
            local.unlink(missing_ok=True)
            raise
    # most recently used: the access time moves, the modification time (part of the
    # file's identity for `verify_cached`) stays
    os.utime(local, ns=(time.time_ns(), local.stat().st_mtime_ns))
    trim(cache, max_cache_gb, keep=local)
    return local


def trim(cache: Path, max_gb: float, keep: Path | None = None) -> list[Path]:
    """Delete least recently used files (by access time) until the cache holds at most
    `max_gb`."""
    files = sorted(
        (p for p in cache.iterdir() if p.is_file() and not p.name.startswith(".fetch-")),
        key=lambda p: p.stat().st_atime,
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
