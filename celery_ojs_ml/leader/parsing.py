"""A job's requirements as the leader reads them from its headers.

Key decision: the leader parses with the same check the gate uses
(`wire.inbound.InboundCheck`, the app's bounds), so the two never disagree on
what a job asks for; a job that does not parse is logged and skipped, never
raised out of a pass.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery_ojs_ml.allocator.policy import with_preemption_limits
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.inbound import BadMessage, InboundCheck

log = logging.getLogger("celery_ojs_ml.leader.loop")

_POLICY = "ext_mlx_scheduling_preemption_policy"
"""OJS ML Extensions §7: a job's preemption policy."""


class Parser:
    """`requirements` of a waiting job, `running` of a running job's lease headers."""

    def __init__(self, check: InboundCheck, max_preemptions: int) -> None:
        self.check = check
        self.max_preemptions = max_preemptions

    def requirements(self, headers: Any) -> MLRequirements | None:
        """The requirements of a job's headers, validated with the app's bounds."""
        try:
            return self.check.requirements(dict(headers))
        except BadMessage as exc:
            log.error("ojs-ml: the scheduler cannot parse a job: %s", exc)
            return None

    def running(self, headers: Any) -> MLRequirements | None:
        """The requirements of a running job's lease headers, with its preemption limits."""
        try:
            req = self.check.parse(dict(headers))
            return with_preemption_limits(
                req,
                policy=_policy(headers),
                preemptions=int(headers.get(h.PREEMPTIONS) or 0),
                max_preemptions=self.max_preemptions,
            )
        except BadMessage as exc:
            log.error("ojs-ml: the scheduler cannot parse a running job: %s", exc)
            return None


def _policy(headers: Mapping[str, Any]) -> str | None:
    value = headers.get(_POLICY)
    return value if isinstance(value, str) else None
