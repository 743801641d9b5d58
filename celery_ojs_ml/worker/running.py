"""The jobs one worker runs or holds: the state its collaborators share.

Key decision: one re-entrant lock guards it all. Under prefork everything runs on
the event loop anyway, but under the threads pool (and the embedded demo)
completions arrive on pool threads and timers on the timer thread. Requests are
keyed by identity: two copies of one task id are two requests.
"""

from __future__ import annotations

import threading
from typing import Any


class Running:
    """Per-job state shared by the gate, lease keeping, grants and gangs (under `lock`)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.requests: dict[str, Any] = {}
        """Task id -> the request dispatched here (dropped at release)."""
        self.devices_by_id: dict[str, tuple[int, ...]] = {}
        """Devices of each dispatched job, for the warm router (dropped at release)."""
        self.tokens: dict[Any, str] = {}
        """Request -> its lease token."""
        self.fenced: set[Any] = set()
        """Requests whose lease another worker took over; their copy is being stopped."""
        self.stopping: set[Any] = set()
        """Gang ranks being stopped because a peer of their placement failed (`gangs`)."""
        self.unacked: dict[Any, bool] = {}
        """Running requests whose lease write failed: their message is acked when they end."""
        self.hold_until: dict[Any, float] = {}
        """Held requests kept past `ojs_ml_max_hold_s` (their victims are yielding)."""

    def forsake(self, req: Any) -> None:
        """Leave a job's lease and message to outlive this run: no longer refreshed,
        released or acked here, so the lease expires (or the broker delivers the message
        again) and whoever claims it re-publishes the job."""
        with self.lock:
            self.tokens.pop(req, None)
            self.unacked.pop(req, None)
