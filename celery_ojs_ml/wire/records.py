"""The records every side keeps of one job, built in one place each.

`job_record`: the job as a lease, a dead letter or a re-publish needs it (task name,
arguments, canonical headers, retries). `stored_message`: a Celery message as the
pending set keeps it (body base64, content type and encoding, headers, properties),
so the leader's intake and a worker handing a delivery back write the same record.

Key decision: a re-published copy keeps only the job's own headers (`ext_ml*`, `ojs_*`)
less those the gate and the router set again for each run (`REPUBLISH_DROPS`).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from celery_ojs_ml.wire import headers as h

REPUBLISH_DROPS = h.REPUBLISH_DROPS


def republish_headers(
    headers: Mapping[str, Any], **counters: int | dict[str, Any] | None
) -> dict[str, Any]:
    """Canonical headers for a re-published copy, with updated counters."""
    keep = {
        k: v
        for k, v in headers.items()
        if k.startswith(("ext_ml", "ojs_")) and k not in REPUBLISH_DROPS
    }
    keep.update({k: v for k, v in counters.items() if v is not None})
    return keep


def job_record(
    task_id: str,
    name: Any,
    args: Any,
    kwargs: Any,
    headers: dict[str, Any],
    retries: int = 0,
) -> dict[str, Any]:
    """`{task_id, name, args, kwargs, headers, retries}`: what re-running the job needs."""
    return {
        "task_id": task_id,
        "name": name,
        "args": list(args),
        "kwargs": dict(kwargs),
        "headers": headers,
        "retries": retries,
    }


def request_record(req: Any, *, retries: int | None = None) -> dict[str, Any]:
    """`job_record` of a worker's Celery request, with its re-publish headers; `retries`
    defaults to the request's own."""
    headers = req.request_dict
    count = int(headers.get("retries") or 0) if retries is None else retries
    return job_record(req.id, req.name, req.args, req.kwargs, republish_headers(headers), count)


def stored_message(
    body: Any,
    content_type: str | None,
    content_encoding: str | None,
    headers: dict[str, Any],
    properties: Mapping[str, Any],
) -> dict[str, Any]:
    """A message as the pending set stores it; properties that are None are left out."""
    raw = body if isinstance(body, bytes) else str(body).encode()
    return {
        "body": base64.b64encode(raw).decode(),
        "content_type": content_type,
        "content_encoding": content_encoding,
        "headers": headers,
        "properties": {k: v for k, v in properties.items() if v is not None},
    }
