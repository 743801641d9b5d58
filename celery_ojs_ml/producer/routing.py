"""Publish side: validate requirements and route ML jobs to the fleet scheduler's intake.

Key decision: a router function in `task_routes` is the one public hook that
sees both the task object (its `ml=` option) and the call's headers, and it runs
before anything is published, so an invalid job raises with the validator's
message and nothing reaches the broker. Jobs without hard constraints return
None and keep the queue plain Celery routing gives them. A task sent without
ML attributes to a queue whose policy has `ml_defaults` is an ML job (OJS ML
§10.1: the defaults apply to every job of the queue); tasks of other queues
are never touched.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from kombu import Queue  # type: ignore[attr-defined]
from kombu.serialization import dumps

from celery_ojs_ml import celery_internals as internals
from celery_ojs_ml.errors import SpecError, Violation
from celery_ojs_ml.lru import LRU
from celery_ojs_ml.matching.hints import Hints
from celery_ojs_ml.scheduler.grants import grant_key, grantable
from celery_ojs_ml.spec.classes import (
    band,
    class_id,
    has_hard_constraints,
)
from celery_ojs_ml.spec.envelope import ParseOptions, requirements_of
from celery_ojs_ml.spec.resources import PROJECT_KEYS, MLRequirements
from celery_ojs_ml.store import granted_jobs
from celery_ojs_ml.store.grants import GrantBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.labels import HEADER_LABELS, declared_labels
from celery_ojs_ml.wire.queues import intake_name, ml_queue, worker_queue_name
from celery_ojs_ml.wire.records import stored_message
from celery_ojs_ml.wire.settings import OJSMLSettings


def declared_attrs(task: Any, headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The task's `ml=` option overlaid with per-call `ext_ml_*`/`ext_mlx_*`/`ojs_ml_gpu_share`
    headers.

    Raises SpecError naming `ml` when the task option is not a mapping; header
    keys that are not strings are not ML attributes (they pass through).
    """
    ml = getattr(task, "ml", None)
    if ml is not None and not isinstance(ml, Mapping):
        raise SpecError(
            Violation(
                "ml",
                f"is {ml!r}, not a mapping of ext_ml_* attributes",
                "OJS ML §3",
                'declare the task with ml={"ext_ml_gpu_count": 1}',
            )
        )
    attrs = dict(ml or {})
    for key, value in (headers or {}).items():
        if _is_ml(key):
            attrs[key] = value
    return attrs


def _is_ml(key: Any) -> bool:
    """`ext_ml_*`, `ext_mlx_*` and this project's requirement keys (`ojs_ml_gpu_share`)."""
    return isinstance(key, str) and (key.startswith("ext_ml") or key in PROJECT_KEYS)


@dataclass(frozen=True, slots=True)
class _Resolved:
    """What the router derives from one (logical queue, declared attributes) pair."""

    req: MLRequirements
    headers: dict[str, Any]
    hard: bool
    cid: str
    band: str


_MEMO_MAX = 1024
"""Resolved declarations (and queues) a router keeps, least recently used dropped first."""
_PROPERTIES = ("correlation_id", "reply_to", "priority", "delivery_mode")
_GRANTED = threading.local()
"""The (plugin, holder, epoch) of the job this thread just routed under a grant."""
_HINT_KEYS = frozenset({"ext_mlx_scheduling_spot_preference", "ext_mlx_scheduling_data_locality"})
_WARNED: set[str] = set()
log = logging.getLogger(__name__)


def without_private(headers: Mapping[str, Any]) -> dict[str, Any]:
    """A producer's headers less the plugin-private ones (`wire.headers.PRIVATE`); each
    name dropped is logged once per process."""
    dropped = sorted(k for k in headers if k in h.PRIVATE)
    fresh = [k for k in dropped if k not in _WARNED]
    if fresh:
        _WARNED.update(fresh)
        log.warning("ojs-ml: ignoring plugin-private headers a producer set: %s", fresh)
    return {k: v for k, v in headers.items() if k not in h.PRIVATE}


def record_granted(
    body: Any = None,
    headers: dict[str, Any] | None = None,
    properties: dict[str, Any] | None = None,
    **_: Any,
) -> None:
    """`before_task_publish`: record a job routed under a grant before it leaves, so a
    holder killed as it takes the job does not lose it (`store.granted_jobs`)."""
    target = getattr(_GRANTED, "job", None)
    if target is None or not headers:
        return
    _GRANTED.job = None
    plugin, worker, epoch = target
    if headers.get(h.GRANT) != epoch or not isinstance(headers.get("id"), str):
        return
    ctype, cenc, data = dumps(body, serializer=plugin.app.conf.task_serializer)  # type: ignore[no-untyped-call]
    props = {k: (properties or {}).get(k) for k in _PROPERTIES}
    msg = stored_message(data, ctype, cenc, dict(headers), props)
    task_id, store = headers["id"], plugin.store

    def alone() -> None:
        try:
            granted_jobs.record(store, worker, task_id, msg)
        except Exception as exc:  # the job still goes out; only its crash-window record is lost
            log.warning("ojs-ml: could not record granted job %s: %s", task_id, exc)

    if not _put_first_ready(plugin):
        alone()
        return

    def first(pipe: Any) -> None:
        granted_jobs.record_in(pipe, store, worker, task_id, msg)

    internals.put_first(task_id, store.client, first, alone)


_PUT_FIRST: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
"""Per plugin: whether its broker is kombu's Redis transport, with `put_first` installed."""


def _put_first_ready(plugin: Any) -> bool:
    """Whether a granted job's record can travel in its publish's round trip (a Redis
    broker: `celery_internals.put_first`); a plugin's answer is worked out once."""
    ready = _PUT_FIRST.get(plugin)
    if ready is None:
        with plugin.app.connection_for_write() as conn:
            redis_broker = conn.transport.driver_type == "redis"
        ready = _PUT_FIRST[plugin] = redis_broker and internals.install_put_first()
    return ready


def _hinted(headers: Mapping[str, Any]) -> bool:
    """Whether the job carries a placement hint that changes its score (§7): such a job
    is placed by the fleet scheduler, never under a class's grant."""
    if not _HINT_KEYS.intersection(headers):
        return False
    return bool(Hints.of(headers))


class Publisher(Protocol):
    """What the router asks of the app's plugin (`plugin.OJSML`) at publish."""

    @property
    def app(self) -> Any: ...

    @property
    def settings(self) -> OJSMLSettings: ...

    @property
    def parse_options(self) -> ParseOptions: ...

    @property
    def defaulted_queues(self) -> frozenset[str]: ...

    @property
    def grant_book(self) -> GrantBook: ...

    @property
    def store(self) -> OJSStore: ...

    def store_errors(self) -> AbstractContextManager[None]: ...

    def check_reservation(self, req: MLRequirements) -> None: ...

    def check_satisfiable(self, req: MLRequirements, cid: str, logical: str) -> str | None: ...

    def grants_on(self, logical: str) -> bool: ...


class MLRouter:
    """The `task_routes` entry installed by `OJSML(app)`.

    Validation, normalisation and the class hash are pure functions of the
    declared attributes and the logical queue, so the router memoises them:
    a producer publishing the same kind of job again pays a dict lookup, not
    the validator. Invalid declarations raise every time (they are not kept).
    """

    def __init__(self, plugin: Publisher) -> None:
        self.plugin = plugin
        self._memo: LRU[tuple[str, str], _Resolved] = LRU(_MEMO_MAX)
        self._queues: LRU[str, Queue] = LRU(_MEMO_MAX)

    def __call__(
        self,
        name: str,
        args: Any,
        kwargs: Any,
        options: dict[str, Any],
        task: Any = None,
        **_: Any,
    ) -> dict[str, Any] | None:
        sent = options.get("headers")
        if sent and not h.PRIVATE.isdisjoint(sent) and not h.trusted():
            options["headers"] = without_private(sent)
        attrs = declared_attrs(task, options.get("headers"))
        if not attrs and not self.plugin.defaulted_queues:
            return None
        logical = self._logical_queue(task, options)
        if not attrs and logical not in self.plugin.defaulted_queues:
            return None  # a plain task of a queue without ml_defaults stays plain Celery
        found = self._resolve(attrs, logical)
        caller = {k: v for k, v in (options.get("headers") or {}).items() if not _is_ml(k)}
        headers = {**caller, **found.headers}  # ML attributes go out in canonical form only
        labels = {
            **declared_labels(getattr(task, "ml_labels", None)),
            **declared_labels(headers.get(HEADER_LABELS), HEADER_LABELS),
        }  # a job's own labels (§7.3): the call's win over the task's
        headers.pop(HEADER_LABELS, None)
        if labels:
            headers[HEADER_LABELS] = labels
        options["headers"] = headers
        if not found.hard and h.GANG not in headers:  # a gang rank is always scheduled
            return None
        return self._route(found, logical, options, headers)

    def _resolve(self, attrs: dict[str, Any], logical: str) -> _Resolved:
        key = (logical, repr(sorted(attrs.items())))
        found = self._memo.get(key)
        if found is None:
            req, mlx, _warnings = requirements_of(attrs, logical, self.plugin.parse_options)
            found = _Resolved(
                req, {**req.flat(), **mlx}, has_hard_constraints(req), class_id(req), band(req)
            )
            self._memo[key] = found
        return found

    def _route(
        self, found: _Resolved, logical: str, options: dict[str, Any], headers: dict[str, Any]
    ) -> dict[str, Any]:
        cid, band_name = found.cid, found.band
        with self.plugin.store_errors():
            if found.req.ext_ml_reservation_id is not None:
                self.plugin.check_reservation(found.req)  # before anything is written (§8.3)
            reason = self.plugin.check_satisfiable(found.req, cid, logical)
        if reason is not None:
            headers[h.PENDING] = reason
        headers.update({h.CLASS: cid, h.BAND: band_name, h.LOGICAL: logical})
        for private in h.DELIVERY:  # a re-published copy is assigned afresh
            headers.pop(private, None)
        name = self._granted(found, logical, headers) or intake_name(
            self.plugin.settings.store_prefix
        )
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = ml_queue(name)
        options["queue"] = queue  # an explicit queue= names the logical queue, not the destination
        return {"queue": queue}

    def _granted(self, found: _Resolved, logical: str, headers: dict[str, Any]) -> str | None:
        """The queue of the worker holding a grant for this job's class, with the grant's
        epoch in the headers; None: the job goes to the intake (`scheduler.grants`)."""
        if headers.get(h.PENDING) or not self.plugin.grants_on(logical):
            return None
        if not grantable(
            found.req,
            gang=h.GANG in headers,
            labels=HEADER_LABELS in headers,
            gpu_affinity=str(headers.get("ext_mlx_scheduling_gpu_affinity") or "pack"),
            hints=_hinted(headers),
        ):
            return None
        with self.plugin.store_errors():
            grant = self.plugin.grant_book.lookup(grant_key(logical, found.band, found.cid))
        if grant is None:
            return None
        worker, epoch = grant
        _GRANTED.job = (self.plugin, worker, epoch)
        headers[h.GRANT] = epoch
        headers[h.GRANT_AT] = round(time.time(), 3)
        return worker_queue_name(self.plugin.settings.store_prefix, worker)

    def _logical_queue(self, task: Any, options: Mapping[str, Any]) -> str:
        explicit = options.get("queue") or (options.get("headers") or {}).get(h.LOGICAL)
        if isinstance(explicit, Queue):
            return str(explicit.name)
        if isinstance(explicit, str) and explicit:
            return explicit
        own = getattr(task, "queue", None)
        return str(own or self.plugin.app.conf.task_default_queue)
