"""The `ojs_gang` header a gang's ranks are published with (Flux RFC 25 `node>slot`).

Key decision: a gang is published as one Celery task per rank, each carrying
{id, size, rank} under `wire.headers.GANG`; the leader places the ranks all at
once and gives each delivery an `ojs_rendezvous` header.
"""

from __future__ import annotations

import uuid
from typing import Any

from celery_ojs_ml.errors import SpecError, Violation
from celery_ojs_ml.wire.headers import GANG

MAX_GANG = 1024
"""The most ranks a gang may have."""


def gang_headers(size: Any) -> list[dict[str, Any]]:
    """One `ojs_gang` header per rank of a new gang of `size`."""
    if not isinstance(size, int) or isinstance(size, bool) or not 2 <= size <= MAX_GANG:
        raise SpecError(
            Violation("size", f"is {size!r}", "Flux RFC 25 node>slot",
                      f"a gang has 2 to {MAX_GANG} ranks; run a single job for one")
        )  # fmt: skip
    gid = f"gang-{uuid.uuid4().hex[:12]}"
    return [{GANG: {"id": gid, "size": size, "rank": r}} for r in range(size)]
