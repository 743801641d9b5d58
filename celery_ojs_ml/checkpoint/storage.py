"""Checkpoint payload storage through fsspec: `file://`, `s3://`, `gs://`, `az://` (OJS ML §9.4).

Key decisions:
- fsspec is the only storage abstraction: s3fs, gcsfs and adlfs plug in through
  the `s3`, `gcs` and `azure` extras, so a new backend needs no code here.
- Storage options (endpoints, credentials profiles) never travel in the job: they
  come from the worker, keyed by URI prefix (`storage_options_for`). Credentials in
  the URI itself are refused by the §15.3 checks.
- Payload files on `file://` are fsynced before the metadata commit, as
  PyTorch's distributed checkpoint writer does by default: a commit that
  survives a power loss must not point at data that did not.
"""

from __future__ import annotations

import io
import os
import re
import shutil
from collections.abc import Mapping
from typing import IO, Any, cast
from urllib.parse import urlsplit

import fsspec
from fsspec.implementations.local import LocalFileSystem

from celery_ojs_ml.checkpoint.model import CheckpointError

SETTING = "ojs_ml_checkpoint_storage_options"
"""Celery setting: {URI prefix or scheme: fsspec options}, e.g. {"s3://": {...}}."""
Source = bytes | bytearray | memoryview | IO[bytes] | str | os.PathLike[str]
"""What `save(files={name: source})` accepts: data, a readable binary file, or a local path."""
_COPY_CHUNK = 8 * 1024 * 1024
_REGISTRY: dict[str, dict[str, Any]] = {}
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:=+@-]{0,254}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f\\]")


def register_storage_options(prefix: str, **options: Any) -> None:
    """Use fsspec `options` for URIs under `prefix` (a scheme such as "s3" or a URI prefix)."""
    _REGISTRY[_prefix(prefix)] = dict(options)


def clear_storage_options() -> None:
    """Forget every `register_storage_options` entry."""
    _REGISTRY.clear()


def storage_options_for(uri: str, app_conf: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The fsspec options for `uri`: the longest matching prefix of the registry or the setting.

    An entry of the Celery setting `ojs_ml_checkpoint_storage_options` wins
    over a registry entry with the same prefix.
    """
    table = {**_REGISTRY, **_setting(app_conf)}
    matches = [p for p in table if uri.startswith(p)]
    return dict(table[max(matches, key=len)]) if matches else {}


def _setting(app_conf: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    raw = (app_conf or {}).get(SETTING) or {}
    if not isinstance(raw, Mapping) or not all(isinstance(v, Mapping) for v in raw.values()):
        raise CheckpointError(
            f"{SETTING} must map URI prefixes to fsspec options, e.g. "
            '{"s3://": {"client_kwargs": {"endpoint_url": "https://minio.internal:9000"}}}, '
            f"but got {raw!r}"
        )
    return {_prefix(str(k)): dict(v) for k, v in raw.items()}


def _prefix(prefix: str) -> str:
    return prefix if "://" in prefix else prefix.rstrip(":/") + "://"


def filesystem(uri: str, options: Mapping[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for `uri` and the path inside it."""
    try:
        fs, path = fsspec.core.url_to_fs(uri, **options)
    except ImportError as exc:
        scheme = urlsplit(uri).scheme
        extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}.get(scheme)
        hint = f"install celery-ojs-ml[{extra}]" if extra else "install the fsspec backend"
        raise CheckpointError(f"no fsspec backend for {scheme}:// ({exc}); {hint}") from None
    return fs, str(path)


def payload_uri(storage_uri: str, job_id: str, sequence: int) -> str:
    """`<storage_uri><job id>/<sequence>/`, the §9.2 `storage_key` of one checkpoint."""
    return f"{storage_uri}{job_segment(job_id)}/{sequence}/"


def job_segment(job_id: str) -> str:
    """`job_id` as one path segment; ids that could escape the prefix are refused."""
    if not _SAFE_ID.fullmatch(job_id) or job_id in (".", ".."):
        raise CheckpointError(
            f"job id {job_id!r} cannot name a checkpoint directory; use letters, digits and "
            "._:=+@- only, e.g. a Celery task id such as 'a3f1c2d4-...' or 'train-run-3'"
        )
    return job_id


def check_name(name: str) -> str:
    """A payload file name: a relative path without '..', e.g. "model.pt" or "optim/state.pt"."""
    parts = name.split("/")
    if not name or _CONTROL.search(name) or any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(
            f"checkpoint file name {name!r} must be a relative path without '.', '..' or "
            "empty segments, e.g. 'model.pt' or 'optim/state.pt'"
        )
    return name


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether `fs` is the local filesystem (where fsync makes sense)."""
    return isinstance(fs, LocalFileSystem)


def prepare_dir(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Create the payload directory where directories exist (local, NFS)."""
    if is_local(fs):
        fs.makedirs(path, exist_ok=True)


def open_for_write(fs: fsspec.AbstractFileSystem, path: str) -> IO[bytes]:
    """A binary file opened for writing, parent directories made where needed."""
    if is_local(fs):
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    return cast(IO[bytes], fs.open(path, "wb"))


def finish(fs: fsspec.AbstractFileSystem, handle: IO[bytes], *, fsync: bool) -> None:
    """Flush `handle` (and fsync it on a local filesystem), then close it."""
    try:
        if fsync and is_local(fs):
            handle.flush()
            os.fsync(handle.fileno())
    finally:
        handle.close()


def write_source(fs: fsspec.AbstractFileSystem, path: str, source: Source, *, fsync: bool) -> int:
    """Write one payload file from bytes, a readable binary file or a local path; its size."""
    handle = open_for_write(fs, path)
    try:
        _copy(source, handle)
        written = int(handle.tell())
    except BaseException:
        handle.close()
        raise
    finish(fs, handle, fsync=fsync)
    return written


def _copy(source: Source, handle: IO[bytes]) -> None:
    if isinstance(source, bytes | bytearray | memoryview):
        handle.write(source)
    elif isinstance(source, str | os.PathLike):
        with open(source, "rb") as src:
            shutil.copyfileobj(src, handle, _COPY_CHUNK)
    elif isinstance(source, io.BytesIO):
        handle.write(source.getbuffer())
    elif hasattr(source, "read"):
        shutil.copyfileobj(source, handle, _COPY_CHUNK)
    else:
        raise CheckpointError(
            f"cannot write a {type(source).__name__} as a checkpoint file; pass bytes, a binary "
            "file object or a local path, e.g. files={'model.pt': buffer.getvalue()}"
        )


def remove(uri: str, options: Mapping[str, Any]) -> None:
    """Delete the payload at `uri` recursively; an absent payload is not an error."""
    fs, path = filesystem(uri, options)
    try:
        fs.rm(path.rstrip("/"), recursive=True)
    except FileNotFoundError:
        return
    invalidate = getattr(fs, "invalidate_cache", None)
    if callable(invalidate):
        invalidate(path.rstrip("/"))
