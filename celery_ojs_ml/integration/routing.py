"""Publish side: validate requirements and route to `<logical>.ml.<class>.<band>`.

Key decision: a router function in `task_routes` is the one public hook that
sees both the task object (its `ml=` option) and the call's headers, and it runs
before anything is published, so an invalid job raises with the validator's
message and nothing reaches the broker. Jobs without hard constraints return
None and keep the queue plain Celery routing gives them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kombu import Exchange, Queue  # type: ignore[attr-defined]

from celery_ojs_ml.spec.classes import band, class_id, hard_constraints, has_hard_constraints
from celery_ojs_ml.spec.envelope import requirements_of
from celery_ojs_ml.spec.resources import MLRequirements

if TYPE_CHECKING:
    from celery_ojs_ml.integration.plugin import OJSML

HEADER_CLASS = "ojs_class"
HEADER_BAND = "ojs_band"
HEADER_LOGICAL = "ojs_logical_queue"
HEADER_PENDING = "ojs_pending"
"""Set when no live worker could run the job at publish; the reason is the value."""
PRIVATE_HEADERS = ("ojs_devices", "ojs_node", "redelivered")


def ml_queue(name: str) -> Queue:
    """The one definition of a requirement-class queue, used by producers and workers alike."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name)  # type: ignore[no-untyped-call]


def queue_name(logical: str, cid: str, band_name: str) -> str:
    """`<logical queue>.ml.<class id>.<band>`."""
    return f"{logical}.ml.{cid}.{band_name}"


def declared_attrs(task: Any, headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The task's `ml=` option overlaid with per-call `ext_ml_*`/`ext_mlx_*` headers."""
    attrs = dict(getattr(task, "ml", None) or {})
    for key, value in (headers or {}).items():
        if key.startswith("ext_ml"):
            attrs[key] = value
    return attrs


class MLRouter:
    """The `task_routes` entry installed by `OJSML(app)`."""

    def __init__(self, plugin: OJSML) -> None:
        self.plugin = plugin

    def __call__(
        self,
        name: str,
        args: Any,
        kwargs: Any,
        options: dict[str, Any],
        task: Any = None,
        **_: Any,
    ) -> dict[str, Any] | None:
        attrs = declared_attrs(task, options.get("headers"))
        if not attrs:
            return None
        logical = self._logical_queue(task, options)
        req, mlx, _warnings = requirements_of(attrs, logical, self.plugin.parse_options)
        headers = {**(options.get("headers") or {}), **req.flat(), **mlx}
        options["headers"] = headers
        if not has_hard_constraints(req):
            return None
        return self._route(req, logical, options, headers, options.get("task_id"))

    def _route(
        self,
        req: MLRequirements,
        logical: str,
        options: dict[str, Any],
        headers: dict[str, Any],
        task_id: str | None,
    ) -> dict[str, Any]:
        cid, band_name = class_id(req), band(req)
        self.plugin.register_class(cid, hard_constraints(req), logical)
        reason = self.plugin.check_satisfiable(req, cid, logical)
        if reason is not None:
            headers[HEADER_PENDING] = reason
        headers.update({HEADER_CLASS: cid, HEADER_BAND: band_name, HEADER_LOGICAL: logical})
        queue = ml_queue(queue_name(logical, cid, band_name))
        options["queue"] = queue  # an explicit queue= names the logical queue, not the destination
        return {"queue": queue}

    def _logical_queue(self, task: Any, options: Mapping[str, Any]) -> str:
        explicit = options.get("queue") or (options.get("headers") or {}).get(HEADER_LOGICAL)
        if isinstance(explicit, Queue):
            return str(explicit.name)
        if isinstance(explicit, str) and explicit:
            return explicit
        own = getattr(task, "queue", None)
        return str(own or self.plugin.app.conf.task_default_queue)
