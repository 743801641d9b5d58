"""Reading and deleting a job's checkpoints from outside the task (CLI, cleanup jobs).

Key decision: deletion removes the metadata first, in one transaction, and the
payloads after, so no reader can ever resume from a payload being deleted; a
payload that survives a failed delete is an orphan that nothing references.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery_ojs_ml.checkpoint import records, storage
from celery_ojs_ml.checkpoint.model import CheckpointMeta
from celery_ojs_ml.store.registry import OJSStore

log = logging.getLogger(__name__)


def list_checkpoints(store: OJSStore, job_id: str) -> list[CheckpointMeta]:
    """The retained committed checkpoints of `job_id`, oldest first (OJS ML §9.2)."""
    return records.list_checkpoints(store, job_id)


def last_checkpoint(store: OJSStore, job_id: str) -> CheckpointMeta | None:
    """The committed `last_checkpoint` of `job_id` (OJS ML §9.2), or None."""
    return records.last_checkpoint(store, job_id)


def delete_checkpoints(
    store: OJSStore,
    job_id: str,
    *,
    storage_uri: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    app_conf: Mapping[str, Any] | None = None,
    remove_payloads: bool = True,
) -> list[CheckpointMeta]:
    """Forget every checkpoint of `job_id` and delete their payloads; returns what was known.

    With `storage_uri` (the job's `ext_ml_checkpoint_storage_uri`) the whole
    `<storage_uri><job id>/` directory goes too, including payloads orphaned
    by a crash between write and commit.
    """
    known = records.drop_all(store, job_id)
    if not remove_payloads:
        return known
    targets = [m.storage_key for m in known]
    if storage_uri is not None:
        base = storage_uri if storage_uri.endswith("/") else storage_uri + "/"
        targets.append(f"{base}{storage.job_segment(job_id)}/")
    for uri in targets:
        options = storage_options
        if options is None:
            options = storage.storage_options_for(uri, app_conf)
        try:
            storage.remove(uri, options)
        except Exception as exc:  # metadata is gone already: what is left is an orphan
            log.warning("ojs-ml: could not delete checkpoint payload %s: %s", uri, exc)
    return known
