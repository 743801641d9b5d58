"""`Checkpointer`: resume, save with a two-phase commit, retention and the preemption flag.

Responsibility: everything a training task does with checkpoints, without
Celery (the task-side glue is `checkpoint(task)` in `task.py`).

Key decision (DESIGN.md decision 6, OJS ML §9.2-§9.3): a save is (a) the payload
written under `<storage_uri><job id>/<seq>/`, then (b) one atomic Redis commit of the
§9.2 metadata, then (c) FIFO eviction of what exceeds `max_count`. A crash before (b)
leaves an orphaned payload that resume never sees; a failure in (c) only delays the
deletion. Resume restores only what `restore.py` trusts (§15.3).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import IO, Any, cast
from urllib.parse import urlsplit

import redis

from celery_ojs_ml.checkpoint import preempt, records, restore, storage
from celery_ojs_ml.checkpoint.model import (
    STORAGE_URI,
    CheckpointError,
    CheckpointMeta,
    CheckpointSettings,
    build_meta,
    utc_timestamp,
)
from celery_ojs_ml.checkpoint.preempt import LeaseLost
from celery_ojs_ml.checkpoint.writer import CheckpointWriter
from celery_ojs_ml.store.registry import OJSStore

log = logging.getLogger(__name__)
Emit = Callable[[str, dict[str, Any]], None]
"""Sends one `ojs-*` event: (event type, fields)."""
POLL_INTERVAL_S = 0.5
"""Shortest time between two Redis polls of the preemption key."""
SAVED, LOADED = "ojs-checkpoint-saved", "ojs-checkpoint-loaded"


class Checkpointer:
    """The checkpoint helper of one running job (see `checkpoint(task)` for Celery tasks)."""

    def __init__(
        self,
        job_id: str,
        settings: CheckpointSettings,
        store: OJSStore,
        *,
        emit: Emit | None = None,
        clock: Callable[[], float] = time.time,
        header_last: Any = None,
        resume_from: str | None = None,
        app_conf: Mapping[str, Any] | None = None,
        lease_token: str | None = None,
    ) -> None:
        storage.job_segment(job_id)
        self._lease_token = lease_token
        self.job_id = job_id
        self.settings = settings
        self.store = store
        self._emit_fn = emit
        self._clock = clock
        self._header_last = header_last
        self._resume_from = resume_from
        self._app_conf = app_conf
        self._last_save_at = clock()
        self._save_began = self._last_save_at
        """When the latest `writer()` opened: `ojs-checkpoint-saved` reports the save's
        duration from it."""
        self._last: CheckpointMeta | None = None
        self._resumed: CheckpointMeta | None = None
        self._resume_done = False
        self._saves = 0
        self._preempt_seen = False
        self._saves_at_request = 0
        self._next_poll = float("-inf")
        self._next_sequence: int | None = None
        self._fs: tuple[Any, str] | None = None
        self._final: dict[str, Any] | None = None
        """The final record the next commit writes (`save(final=True)`)."""
        self._before_commit: Callable[[CheckpointMeta], None] | None = None
        """Test seam only: runs between the payload write and the commit (crash tests)."""

    @property
    def last(self) -> CheckpointMeta | None:
        """The newest checkpoint known to this run: saved here, or the one resumed from."""
        return self._last

    # -- resume (OJS ML §9.3) ------------------------------------------------------------------

    def resume(self) -> CheckpointMeta | None:
        """The checkpoint to resume from, or None (with a warning) to start from the beginning.

        Reads, in order: the committed metadata in Redis, the `ojs_last_checkpoint`
        header of a re-published job, then `ext_mlx_training_resume_from`. Header values
        are untrusted (§15.3): a record is restored only by its own job, from that job's
        own directory, and (by default) only if the store committed it (`restore.py`).
        """
        if self._resume_done:
            return self._resumed
        found = restore.find(
            self.job_id, self.settings, self.store, self._header_last, self._resume_from
        )
        self._resume_done = True
        if found is None:
            log.warning(
                "ojs-ml: %s has no valid checkpoint; starting from the beginning (OJS ML §9.3)",
                self.job_id,
            )
            return None
        meta, source = found
        self._resumed = meta
        self._last = self._last or meta
        log.info(
            "ojs-ml: %s resumes from checkpoint %s (epoch %s, step %s) at %s, from %s (§9.3)",
            self.job_id,
            meta.sequence,
            meta.epoch,
            meta.step,
            meta.storage_key,
            source,
        )
        self._emit(LOADED, meta, source=source)
        return meta

    def open(self, name: str | None = None, mode: str = "rb") -> IO[Any]:
        """Open a file of the resumed checkpoint, e.g. `ckpt.open("model.pt")`."""
        if mode not in ("rb", "r"):
            raise CheckpointError(f"checkpoints open read-only; use mode='rb', not {mode!r}")
        meta = self.resume()
        if meta is None:
            raise CheckpointError(
                f"{self.job_id} has no checkpoint to read; check that ckpt.resume() returned one"
            )
        uri = self._file_uri(meta.storage_key, name)
        fs, path = storage.filesystem(uri, self._options(uri))
        return cast(IO[Any], fs.open(path, mode))

    def load_bytes(self, name: str | None = None) -> bytes:
        """The content of one file of the resumed checkpoint."""
        with self.open(name) as handle:
            return bytes(handle.read())

    @staticmethod
    def _file_uri(key: str, name: str | None) -> str:
        if not key.endswith("/"):
            if name:
                raise CheckpointError(
                    f"checkpoint {key!r} is a single file; call ckpt.open() without a name"
                )
            return key
        if not name:
            raise CheckpointError(
                f"checkpoint {key!r} is a directory; name a file, e.g. 'model.pt'"
            )
        return key + storage.check_name(name)

    # -- save (OJS ML §9.2) --------------------------------------------------------------------

    def due(self) -> bool:
        """Whether a periodic checkpoint is due: `interval_s` since the last save, or the start."""
        if not self.settings.enabled:
            return False
        return self._clock() - self._last_save_at >= self.settings.interval_s

    def save(
        self,
        *,
        epoch: int | None = None,
        step: int | None = None,
        loss: float | None = None,
        metrics: Mapping[str, Any] | None = None,
        files: Mapping[str, storage.Source] | None = None,
        final: bool = False,
        result: Any = None,
    ) -> CheckpointMeta:
        """Write `files` and commit the checkpoint atomically; returns its metadata.

        `final=True` on the job's last save marks it done in the same commit, with
        `result` (JSON-able) as what the task returns: a copy of the job delivered
        again (its worker died before the result was stored) is not run again; the
        worker stores `result` as its result instead (docs/checkpoint.md)."""
        self._final = records.final_record(self.job_id, result) if final else None
        try:
            with self.writer(epoch=epoch, step=step, loss=loss, metrics=metrics) as w:
                for name, source in (files or {}).items():
                    w.write(name, source)
        finally:
            self._final = None  # committed with this save, or not at all
        return w.meta

    def writer(
        self,
        *,
        epoch: int | None = None,
        step: int | None = None,
        loss: float | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> CheckpointWriter:
        """A writer for streaming files; the checkpoint commits when its `with` block ends."""
        storage_uri = self._storage_uri()
        self._save_began = self._clock()
        fields = {"job_id": self.job_id, "epoch": epoch, "step": step, "loss": loss}
        draft = build_meta({**fields, "metrics": dict(metrics or {}), "storage_key": storage_uri})
        sequence = self._next_sequence or records.next_sequence(self.store, self.job_id)
        self._next_sequence = None
        key = storage.payload_uri(storage_uri, self.job_id, sequence)
        draft = draft.model_copy(update={"storage_key": key, "sequence": sequence})
        fs, base = self._storage_fs(storage_uri)
        return CheckpointWriter(
            draft,
            fs,
            f"{base}/{self.job_id}/{sequence}/",
            fsync=self.settings.fsync,
            on_commit=self._commit,
            on_abandon=self._abandon,
        )

    def _storage_fs(self, storage_uri: str) -> tuple[Any, str]:
        if self._fs is None:
            self.settings.check_storage(storage_uri)  # again where storage opens (§15.3)
            fs, path = storage.filesystem(storage_uri, self._options(storage_uri))
            self._fs = (fs, path.rstrip("/"))
        return self._fs

    def _storage_uri(self) -> str:
        if self.settings.storage_uri is None:
            raise CheckpointError(
                f"{STORAGE_URI} is not set, so there is nowhere to save a checkpoint (OJS ML "
                f'§9.1); set it, e.g. ml={{"{STORAGE_URI}": "s3://bucket/checkpoints/"}}'
            )
        return self.settings.storage_uri

    def _commit(self, w: CheckpointWriter) -> CheckpointMeta:
        """Phase two of a save (DESIGN decision 6): the metadata, atomically, in Redis."""
        meta = self._final_meta(w)
        final, self._final = self._final, None
        if final is not None:
            final["sequence"] = meta.sequence
        try:
            committed = records.commit(
                self.store, meta, self.settings.max_count, self._lease_token, final
            )
        except LeaseLost:
            log.warning(
                "ojs-ml: %s was taken over by another worker; checkpoint %s is dropped and "
                "this copy stops",
                self.job_id,
                meta.sequence,
            )
            self._abandon(w)
            raise
        except redis.RedisError as exc:
            # The server may have applied the commit before the reply was lost, so the
            # payload is kept: uncommitted it is invisible, committed it is needed.
            raise CheckpointError(
                f"the metadata commit of checkpoint {meta.sequence} of {self.job_id} failed "
                f"({exc}); unless it reached Redis the checkpoint does not exist for resume "
                "(OJS ML §9.2); check the store and save again"
            ) from exc
        self._committed(meta, committed.next_sequence, committed.queued)
        return meta

    def _final_meta(self, w: CheckpointWriter) -> CheckpointMeta:
        """The checkpoint's metadata once its payload is written; the payload is removed
        again when this fails (nothing was committed)."""
        try:
            if not w.names:  # a metadata-only checkpoint still names an existing directory
                storage.prepare_dir(w.fs, w.root)
            meta = w.draft.model_copy(
                update={
                    "created_at": utc_timestamp(self._clock()),
                    "size_bytes": w.size_bytes,
                    "files": w.names,
                }
            )
            if self._before_commit is not None:
                self._before_commit(meta)
        except BaseException:
            self._abandon(w)
            raise
        return meta

    def _committed(self, meta: CheckpointMeta, next_sequence: int, queued: int) -> None:
        self._saves += 1
        self._last = meta
        self._last_save_at = self._clock()
        log.info(
            "ojs-ml: %s committed checkpoint %s (epoch %s, step %s, %s bytes) at %s",
            *(self.job_id, meta.sequence, meta.epoch, meta.step, meta.size_bytes, meta.storage_key),
        )
        self._next_sequence = next_sequence
        if queued:
            self.evict_expired()
        self._emit(SAVED, meta, duration_s=max(0.0, self._last_save_at - self._save_began))

    def _abandon(self, w: CheckpointWriter) -> None:
        try:
            storage.remove(w.storage_key, self._options(w.storage_key))
        except Exception as exc:  # the payload is uncommitted, hence invisible, either way
            log.warning("ojs-ml: could not remove abandoned payload %s: %s", w.storage_key, exc)

    def evict_expired(self) -> int:
        """Delete the payloads of checkpoints evicted by FIFO retention; returns how many.

        Never raises: a payload that cannot be deleted now stays queued and is
        retried at the next save.
        """
        done = 0
        try:
            queued = records.expired(self.store, self.job_id)
        except redis.RedisError as exc:
            log.warning("ojs-ml: could not read expired checkpoints of %s: %s", self.job_id, exc)
            return 0
        for raw, meta in queued:
            try:
                storage.remove(meta.storage_key, self._options(meta.storage_key))
                records.forget_expired(self.store, self.job_id, raw)
            except Exception as exc:  # eviction must never undo or fail a commit
                log.warning(
                    "ojs-ml: could not delete expired checkpoint %s of %s (%s); retrying later",
                    *(meta.storage_key, self.job_id, exc),
                )
                continue
            done += 1
        return done

    def _options(self, uri: str) -> dict[str, Any]:
        own = self.settings.storage_uri
        if own and self.settings.storage_options and _scheme(uri) == _scheme(own):
            return dict(self.settings.storage_options)
        return storage.storage_options_for(uri, self._app_conf)

    # -- preemption (OJS ML §8.2) --------------------------------------------------------------

    @property
    def preempt_requested(self) -> bool:
        """Whether this job was asked to yield: SIGUSR2 in this process, or the Redis key.

        Costs nothing in the common case: the signal flag is a process-local bool, and
        Redis is polled at most every `POLL_INTERVAL_S` (0.5 s)."""
        if not self._preempt_seen and (preempt.flag_set() or self._poll_preempt_key()):
            self._preempt_seen = True
            self._saves_at_request = self._saves
            log.info("ojs-ml: %s: preemption requested", self.job_id)
        return self._preempt_seen

    def _poll_preempt_key(self) -> bool:
        now = self._clock()
        if now < self._next_poll:
            return False
        self._next_poll = now + POLL_INTERVAL_S
        try:
            return preempt.preemption_requested(self.store, self.job_id)
        except redis.RedisError as exc:
            log.warning("ojs-ml: could not poll the preemption key of %s: %s", self.job_id, exc)
            return False

    def yield_if_preempted(self) -> None:
        """Raise `Preempted` if a preemption was requested; call it at a safe point."""
        if not self.preempt_requested:
            return
        if self.settings.on_preempt and self._saves == self._saves_at_request:
            log.warning(
                "ojs-ml: %s yields to preemption without a checkpoint saved since the request, "
                "although ext_ml_checkpoint_on_preempt is true (OJS ML §8.2); call ckpt.save(...) "
                "when ckpt.preempt_requested is true, before ckpt.yield_if_preempted()",
                self.job_id,
            )
        with contextlib.suppress(redis.RedisError):
            preempt.clear_preemption(self.store, self.job_id)
        last = self._last
        raise preempt.Preempted(
            self.job_id,
            epoch=last.epoch if last else None,
            sequence=last.sequence if last else None,
        )

    def _emit(self, event: str, meta: CheckpointMeta, **extra: Any) -> None:
        if self._emit_fn is None:
            return
        try:
            self._emit_fn(event, {**meta.to_dict(), **extra})
        except Exception as exc:  # telemetry must never fail a checkpoint
            log.warning("ojs-ml: could not send %s for %s: %s", event, self.job_id, exc)


def _scheme(uri: str) -> str:
    return urlsplit(uri).scheme
