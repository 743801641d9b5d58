"""Which checkpoint a job resumes from, and what it may trust (OJS ML §9.3, §15.3).

Responsibility: pick the checkpoint `Checkpointer.resume()` restores (`find`): the
store's committed record, the `ojs_last_checkpoint` header of a re-published job, or
`ext_mlx_training_resume_from`, refusing untrusted ones with a logged reason; it
never raises for a bad header.

Key decision (§15.3: workers MUST NOT restore from untrusted sources): a record is
trusted only when it is this job's and lies in its own payload directory
(`record_problem`), and by default a header only when the store holds it as a
committed checkpoint of the job; the store's record always wins.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_ojs_ml.checkpoint import records
from celery_ojs_ml.checkpoint.model import CheckpointMeta, CheckpointSettings, parse_meta
from celery_ojs_ml.spec import uris
from celery_ojs_ml.spec.bounds import Bounds
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h

log = logging.getLogger(__name__)
Found = tuple[CheckpointMeta, str]
"""A checkpoint to resume from and its source: `store`, `ojs_last_checkpoint` or the URI."""


def find(
    job_id: str,
    settings: CheckpointSettings,
    store: OJSStore,
    header: Any = None,
    resume_from: str | None = None,
) -> Found | None:
    """The trusted checkpoint `job_id` resumes from, or None; refusals are logged."""
    committed = _committed(job_id, settings, store)
    from_header = _header(job_id, settings, store, header, committed)
    if committed is not None:
        return committed, "store"
    if from_header is not None:
        return from_header, h.LAST_CHECKPOINT
    if resume_from:
        problem = resume_from_problem(resume_from, settings.bounds)
        if problem is None:
            named = CheckpointMeta(job_id=job_id, storage_key=resume_from)
            return named, "ext_mlx_training_resume_from"
        log.warning("ojs-ml: ignoring ext_mlx_training_resume_from: it %s", problem)
    return None


def _committed(job_id: str, settings: CheckpointSettings, store: OJSStore) -> CheckpointMeta | None:
    meta: CheckpointMeta | None = None
    problem: str | None = None
    try:
        meta = records.last_checkpoint(store, job_id)
    except ValueError as exc:  # a corrupt record is no checkpoint (§9.3), not a crash
        problem = f"cannot be read ({exc})"
    if meta is not None:
        problem = record_problem(job_id, meta, settings)
    if problem is None:
        return meta
    log.warning(
        "ojs-ml: ignoring the committed checkpoint of %s in the store: it %s", job_id, problem
    )
    return None


def _header(
    job_id: str,
    settings: CheckpointSettings,
    store: OJSStore,
    header: Any,
    committed: CheckpointMeta | None,
) -> CheckpointMeta | None:
    """The header's record if it may be restored, else None (the refusal is logged).

    By default a header is restored only when the store holds it as a committed
    checkpoint of the job (§9.2), a cross-check of the store.
    `ojs_ml_checkpoint_restore = "own_directory"` drops the commit condition, for a
    store that lost its records or a v0.1 §4.4 envelope from another backend.
    """
    if header is None:
        return None
    parsed = parse_meta(header, job_id)
    if isinstance(parsed, str):
        problem: str | None = parsed
    else:
        problem = record_problem(job_id, parsed, settings)
        if problem is None and settings.restore == "committed":
            problem = _uncommitted_problem(job_id, parsed, store, committed)
    if problem is None and isinstance(parsed, CheckpointMeta):
        return parsed
    log.warning("ojs-ml: ignoring the ojs_last_checkpoint header of %s: it %s", job_id, problem)
    return None


def _uncommitted_problem(
    job_id: str, meta: CheckpointMeta, store: OJSStore, committed: CheckpointMeta | None
) -> str | None:
    if committed is not None and meta.storage_key == committed.storage_key:
        return None
    try:
        retained = {m.storage_key for m in records.list_checkpoints(store, job_id)}
    except ValueError:  # a corrupt history trusts nothing rather than crashing
        retained = set()
    if meta.storage_key in retained:
        return None
    return (
        f"is not a committed checkpoint of {job_id} in the store (OJS ML §15.3); set "
        'app.conf.ojs_ml_checkpoint_restore = "own_directory" to trust headers'
    )


def record_problem(job_id: str, meta: CheckpointMeta, settings: CheckpointSettings) -> str | None:
    """Why `meta` may not be restored by `job_id` (OJS ML §15.3); None if it may.

    Trusted: the record is this job's (`job_id`), its `storage_key` passes the
    storage-URI allow-list and lies in `<ext_ml_checkpoint_storage_uri><job id>/`,
    where only this job's commits write. No wider prefix is trusted: a header is
    written by whoever published the message, so a shared root would let one job
    read another job's checkpoint.
    """
    if meta.job_id != job_id:
        return f"belongs to job {meta.job_id!r}, not {job_id!r} (OJS ML §15.3)"
    key = meta.storage_key
    problem = key_problem(key, settings.bounds, prefixes=False)
    if problem is not None:
        return problem
    if settings.storage_uri is None:
        return (
            f"has storage_key {key!r}, but the job has no ext_ml_checkpoint_storage_uri, so no "
            "checkpoint directory of its own (OJS ML §15.3)"
        )
    home = f"{settings.storage_uri}{job_id}/"
    if not uris.under_prefix(key, home):
        where = f"outside this job's checkpoint directory {home!r}"
        return f"has storage_key {key!r} {where} (OJS ML §15.3)"
    return None


def key_problem(key: str, bounds: Bounds, *, prefixes: bool = True) -> str | None:
    """Why `key` fails the storage-URI allow-list (`ojs_ml_checkpoint_schemes`/`_prefixes`).

    A record needs no prefix check (`prefixes=False`): it is restored only from its
    job's own directory, under a storage URI that passed the prefixes and the reach
    rule (`uris.checkpoint_problems`)."""
    problems = [p.text for p in uris.uri_problems(key, bounds.checkpoint_schemes, "§15.3")]
    allowed = bounds.checkpoint_prefixes if prefixes else ()
    if not problems and allowed and not any(uris.under_prefix(key, p) for p in allowed):
        problems.append(f"is outside the allowed prefixes {list(allowed)}")
    return f"has storage_key {key!r} that " + "; ".join(problems) if problems else None


def resume_from_problem(uri: str, bounds: Bounds) -> str | None:
    """Why `ext_mlx_training_resume_from` may not be restored (§15.3, Extensions §12.1).

    It names weights, an artifact: the artifact prefixes decide its reach."""
    problem = key_problem(uri, bounds)
    if problem is not None:
        return problem
    reach = uris.reach_problem(uri, bounds.artifact_prefixes)
    return (
        None if reach is None else f"has storage_key {uri!r} that {reach} (OJS ML Extensions §12.1)"
    )
