"""The streaming form of a checkpoint save: `with ckpt.writer(...) as w: ...`.

Key decision: the writer is phase a of the two-phase commit (OJS ML §9.2,
"Uploading") and nothing else. Leaving the `with` block cleanly hands it to the
checkpointer for the commit; leaving it with an exception abandons it, so a
half-written payload never gets metadata and never exists for resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import IO

import fsspec

from celery_ojs_ml.checkpoint import storage
from celery_ojs_ml.checkpoint.model import CheckpointError, CheckpointMeta


class CheckpointWriter:
    """Writes the files of one checkpoint under its `storage_key`, then commits or abandons."""

    def __init__(
        self,
        draft: CheckpointMeta,
        fs: fsspec.AbstractFileSystem,
        root: str,
        *,
        fsync: bool,
        on_commit: Callable[[CheckpointWriter], CheckpointMeta],
        on_abandon: Callable[[CheckpointWriter], None],
    ) -> None:
        self.draft = draft
        self.fs = fs
        self.root = root.rstrip("/") + "/"
        self._fsync = fsync
        self._on_commit = on_commit
        self._on_abandon = on_abandon
        self._paths: dict[str, str] = {}
        self._sizes: dict[str, int] = {}
        self._meta: CheckpointMeta | None = None
        self._closed = False

    @property
    def storage_key(self) -> str:
        """The URI the payload is written under, `<storage_uri><job id>/<sequence>/`."""
        return self.draft.storage_key

    @property
    def names(self) -> list[str]:
        """The file names written so far, in order."""
        return list(self._paths)

    @property
    def paths(self) -> list[str]:
        """The filesystem paths written so far, in order."""
        return list(self._paths.values())

    @property
    def size_bytes(self) -> int:
        """The total size of the files written so far."""
        return sum(self._sizes.values())

    @property
    def meta(self) -> CheckpointMeta:
        """The committed metadata; only after the `with` block ended cleanly."""
        if self._meta is None:
            raise CheckpointError(
                "this checkpoint is not committed yet; read writer.meta after the `with` block"
            )
        return self._meta

    def write(self, name: str, source: storage.Source) -> None:
        """Write one file from bytes, a readable binary file or a local path."""
        path = self._claim(name)
        self._sizes[name] = storage.write_source(self.fs, path, source, fsync=self._fsync)

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        """A binary file to stream one payload file into, e.g. `torch.save(state, f)`."""
        path = self._claim(name)
        handle = storage.open_for_write(self.fs, path)
        try:
            yield handle
        except BaseException:
            with contextlib.suppress(Exception):
                handle.close()
            raise
        storage.finish(self.fs, handle, fsync=self._fsync)
        self._sizes[name] = int(self.fs.size(path))  # a stream may have seeked: ask the store

    def _claim(self, name: str) -> str:
        if self._closed:
            raise CheckpointError(f"checkpoint {self.storage_key} is already closed")
        storage.check_name(name)
        if name in self._paths:
            raise CheckpointError(f"checkpoint file {name!r} is written twice; use distinct names")
        self._paths[name] = self.root + name
        return self._paths[name]

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closed = True
        if exc_type is None:
            self._meta = self._on_commit(self)
        else:
            self._on_abandon(self)
