"""`OJSML(app)`: add ML routing, worker capabilities and GPU pinning to a Celery app.

Key decision: the plugin plugs in only through public hooks (a `task_routes`
router, a `before_task_publish` receiver, consumer bootsteps, a worker CLI
option and remote-control commands), so every task without ML attributes
behaves exactly as in plain Celery.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from celery import Celery, signals
from celery.canvas import Signature

from celery_ojs_ml.errors import ConfigError, StoreUnavailable, UnsatisfiableError
from celery_ojs_ml.producer.eligibility import Eligibility, LiveWorker
from celery_ojs_ml.producer.routing import MLRouter, record_granted
from celery_ojs_ml.producer.submission import Submission
from celery_ojs_ml.spec.envelope import ParseOptions
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.store import connect
from celery_ojs_ml.store.grants import (
    GrantBook,
    end_grants_of,
    grants_usable,
    locate_granted,
    queue_grantable,
)
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.settings import OJSMLSettings, read_settings

log = logging.getLogger(__name__)
_TAKE_BACK_S = 5.0
"""How long `prioritize` waits for the leader to take back a job sent under a grant."""
_IN_FLIGHT_S = 0.5
"""How long `prioritize` looks again for a job it finds nowhere (a message a worker has
popped off its queue is in no list until kombu records it as unacknowledged)."""
_ROUTED = threading.local()
"""The plugin that routed the message being published on this thread (router -> publish)."""


class OJSML:
    """The plugin object; one per Celery app (`OJSML(app)` is idempotent)."""

    def __init__(self, app: Celery) -> None:
        existing = getattr(app, "ojs_ml", None)
        self.app = app
        self._settings: OJSMLSettings | None = None
        self._store: OJSStore | None = None
        self.eligibility = Eligibility(lambda: self.store)
        self.submission = Submission(app, lambda: self.parse_options, self.check_reservation)
        self._grants: GrantBook | None = None
        self._grants_on: bool | None = None
        if isinstance(existing, OJSML):
            return
        app.ojs_ml = self
        self._install_router()
        signals.before_task_publish.connect(_apply_time_limit, weak=False)
        signals.before_task_publish.connect(_record_pending, weak=False)
        signals.before_task_publish.connect(record_granted, weak=False)
        from celery_ojs_ml.child import batch as child_batch
        from celery_ojs_ml.child import hooks as child_hooks
        from celery_ojs_ml.leader.process import start_candidate
        from celery_ojs_ml.producer import dedup
        from celery_ojs_ml.worker.core import install

        child_hooks.install()
        install(app, children=child_hooks.POOL_CHILDREN, start_candidate=start_candidate)
        dedup.install(app)
        child_batch.install(app)  # `ml_batch` tasks take their batch (docs/serving.md)

    # -- configuration -------------------------------------------------------------------------

    @property
    def settings(self) -> OJSMLSettings:
        """`ojs_ml_*` settings, read once and cached."""
        if self._settings is None:
            self._settings = read_settings(self.app.conf)
        return self._settings

    @property
    def parse_options(self) -> ParseOptions:
        """Validator options (bounds, queue policies) from the settings."""
        return self.settings.parse_options()

    @property
    def store(self) -> OJSStore:
        """The Redis store; `ojs_ml_store_url`, else the broker URL when that is Redis
        or Redis Sentinel (`store.connect`)."""
        if self._store is None:
            source = self._store_source()
            if source is None:
                raise ConfigError(
                    "ojs_ml_store_url is not set and the broker is not Redis; set it, e.g. "
                    'app.conf.ojs_ml_store_url = "redis://127.0.0.1:6379/2"'
                )
            s = self.settings
            self._store = OJSStore.from_url(
                source.url,
                prefix=s.store_prefix,
                options=source.options,
                origin=source.origin,
                replicas=s.store_wait_replicas,
                replica_wait_ms=s.store_wait_timeout_ms,
            )
        return self._store

    def _store_source(self) -> connect.Source | None:
        conf = self.app.conf
        return connect.source_of(
            self.settings.store_url,
            self.settings.store_transport_options,
            conf.broker_url,
            conf.broker_transport_options,
            conf.broker_use_ssl,
        )

    @property
    def defaulted_queues(self) -> frozenset[str]:
        """Logical queues whose policy has `ml_defaults`: their tasks are ML jobs (§10.1)."""
        return self.settings.defaulted_queues

    def store_url(self) -> str:
        """The store's URL as configured, with any password masked (for messages)."""
        source = self._store_source()
        return "(no store URL)" if source is None else connect.masked(source.url)

    @contextmanager
    def store_errors(self) -> Iterator[None]:
        """Turn a store failure at publish into one `StoreUnavailable` naming the store."""
        try:
            yield
        except redis.RedisError as exc:
            raise StoreUnavailable(
                f"the OJS ML store at {self.store_url()} is unavailable ({exc}); nothing was "
                "published. Check that Redis is up and ojs_ml_store_url is right, then retry"
            ) from exc

    def use_store(self, store: OJSStore) -> None:
        """Use a given store (the embedded demo passes a fakeredis one)."""
        self._store = store
        if self._grants is not None:
            self._grants.close()  # its watch connection was to the old store
        self._grants = None

    @property
    def grant_book(self) -> GrantBook:
        """The grants of this app's store (`store.grants`)."""
        if self._grants is None:
            self._grants = GrantBook(self.store)
        return self._grants

    def grants_on(self, logical: str) -> bool:
        """Whether jobs of `logical` may be published under a grant (`grants_usable`)."""
        if self._grants_on is None:
            self._grants_on = grants_usable(self.app)
        return self._grants_on and queue_grantable(self.settings, logical)

    def _install_router(self) -> None:
        routes = self.app.conf.task_routes
        existing = (
            list(routes) if isinstance(routes, list | tuple) else ([routes] if routes else [])
        )
        self.app.conf.task_routes = [MLRouter(self), *existing]

    # -- publish-side helpers used by the router ---------------------------------------------

    def live_workers(self) -> list[LiveWorker]:
        """(capabilities, consumed queues) of the live workers, cached for a second."""
        return self.eligibility.live_workers()

    def check_satisfiable(self, req: MLRequirements, cid: str, logical: str) -> str | None:
        """The pending reason when no live worker could ever run the job, else None
        (`producer.eligibility`); with `ojs_ml_deny_unsatisfiable` it raises instead."""
        reason = self.eligibility.reason(req, cid, logical)
        if reason is None:
            return None
        if self.settings.deny_unsatisfiable and not h.trusted():  # a re-publish (crash
            # recovery, preemption) goes to the intake: the leader denies it after
            # `ojs_ml_deny_after_s` if no capable worker comes back, it is never dropped
            raise UnsatisfiableError(
                f"no live worker can ever run this job: {reason}; start a worker that can, "
                "or set ojs_ml_deny_unsatisfiable=False to let the job wait"
            )
        _ROUTED.plugin = self
        return reason

    def mark_pending(self, headers: dict[str, Any]) -> None:
        """Store the pending record of a job being published and announce it (OJS §7.2)."""
        task_id = str(headers.get("id"))
        record = {
            "reason": headers[h.PENDING],
            "task": headers.get("task"),
            "class_id": headers.get(h.CLASS),
            "band": headers.get(h.BAND),
            "queue": headers.get(h.LOGICAL),
        }
        try:
            self.store.set_pending(task_id, record)
            with self.app.events.default_dispatcher() as dispatcher:
                dispatcher.send("ojs-resource-waiting", uuid=task_id, **record)
        except Exception as exc:  # the job is published either way; say why it waits in the log
            log.warning("ojs-ml: could not record that %s waits (%s): %s", task_id, record, exc)
        log.info("ojs-ml: %s waits: %s", task_id, record["reason"])

    # -- OJS documents and gangs (`producer.submission`) ----------------------------------------

    def signature_for(self, doc: Any) -> Signature:
        """A Celery signature for an OJS envelope, a workflow or a Flux jobspec."""
        return self.submission.signature_for(doc)

    def submit(self, doc: Any) -> Any:
        """Validate and publish an OJS envelope (either form), a workflow or a Flux jobspec."""
        return self.submission.submit(doc)

    def gang(self, sig: Signature, size: int) -> Any:
        """Run `sig` as a gang of `size` ranks, all placed at once or none (`Submission.gang`)."""
        return self.submission.gang(sig, size)

    # -- RFC 27 requests on the pending set ---------------------------------------------------

    def prioritize(self, task_id: str, priority: int) -> bool:
        """RFC 27 prioritize: reorder a job no worker has started; False when none waits.

        A job assigned but not started yet (delivered ahead with `ojs_ml_prefetch`, or
        held while its victims yield) is taken back first, fenced by its token, so it
        is placed again in its new order; a gate that starts it first wins.
        """
        from celery_ojs_ml.store.pending import ASSIGNED, PendingBook

        book = PendingBook(self.store)

        def reorder() -> bool:
            if book.prioritize(task_id, priority):
                return True
            record = book.get(task_id) or {}
            token = record.get("token")
            if record.get("state") == ASSIGNED and token:
                why = f"prioritized to {int(priority)}: placed again in its new order"
                if book.take_back(task_id, str(token), why, cool=False):
                    return book.prioritize(task_id, priority)
            return False

        changed = reorder() or self._reorder_granted(task_id, reorder)
        if changed:
            self._wake()
        return changed

    def _reorder_granted(self, task_id: str, reorder: Any) -> bool:
        """A job sent under a grant (`store.grants`): end its holder's grants, so
        the leader takes it back, then reorder it once it waits in the pending set."""
        if not grants_usable(self.app):
            return False
        found = locate_granted(self, task_id)
        seek = time.monotonic() + _IN_FLIGHT_S
        while found is None:  # between a worker's BRPOP and kombu's unacked entry?
            if reorder():
                return True
            if time.monotonic() > seek:
                return False
            time.sleep(0.05)
            found = locate_granted(self, task_id)
        end_grants_of(self, found[0])
        self._wake()
        deadline = time.monotonic() + _TAKE_BACK_S
        while time.monotonic() < deadline:
            if reorder():
                return True
            time.sleep(0.05)
        return False

    def cancel(self, task_id: str) -> bool:
        """RFC 27 cancel: drop a job no worker has started and revoke it; False if not waiting."""
        from celery_ojs_ml.store.pending import PendingBook

        dropped = PendingBook(self.store).cancel(task_id)
        self.app.control.revoke(task_id)
        return dropped

    # -- reservations (OJS ML §8.3; docs/scheduling.md) ------------------------------------

    def reserve(
        self,
        requirements: dict[str, Any],
        *,
        reservation_id: str | None = None,
        timeout_s: float | None = None,
    ) -> str:
        """Create a reservation of `requirements` (the job vocabulary) and return its id.

        The scheduler places it like a job and holds its capacity idle for the
        jobs that name it in `ext_ml_reservation_id`; it ends at `release` or
        after `timeout_s` (else the requirements' `ext_ml_reservation_timeout_s`,
        else `ojs_ml_reservation_timeout_s`).
        """
        from celery_ojs_ml.store.reservations import ReservationBook, new_id, reservable

        rid = new_id(reservation_id)
        req, timeout = reservable(requirements, timeout_s, self.parse_options, self.settings)
        with self.store_errors():
            ReservationBook(self.store).create(rid, req.flat(), timeout)
        self._wake()
        return rid

    def check_reservation(self, req: MLRequirements) -> None:
        """§8.3 MUST verify at publish: the job's reservation exists and can hold it."""
        from celery_ojs_ml.spec.envelope import requirements_of
        from celery_ojs_ml.store.reservations import ReservationBook, check_at_publish

        def static(rid: str) -> bool:  # a worker labelled reservation_id (a static reservation)
            return any(
                c.derived_labels().get("reservation_id") == rid for c, _ in self.live_workers()
            )

        def parse(attrs: Any) -> MLRequirements:
            return requirements_of(attrs, None, self.parse_options)[0]

        book = ReservationBook(self.store)
        check_at_publish(book, req, static, self.settings.max_reservation_s, parse)

    def release(self, reservation_id: str) -> bool:
        """End a reservation: its idle capacity is free again; False if it was not held."""
        from celery_ojs_ml.store.reservations import ReservationBook

        with self.store_errors():
            ended = ReservationBook(self.store).end(reservation_id, "released")
        self._wake()
        return ended

    def reservations(self) -> dict[str, dict[str, Any]]:
        """Every reservation record by id (`celery ojs-ml reservations` prints them)."""
        from celery_ojs_ml.store.reservations import ReservationBook

        return ReservationBook(self.store).all()

    def _wake(self) -> None:
        from celery_ojs_ml.store.broker import send_wake

        try:
            send_wake(self.app, "api")
        except Exception as exc:  # the scheduler passes on its own interval too
            log.debug("ojs-ml: could not wake the scheduler: %s", exc)


def _apply_time_limit(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """`before_task_publish`: each publish of an ML job gets a unique `ojs_msg` id (admission
    is idempotent per message, `PendingBook.admit_many`); §14.3: ext_ml_timeout_seconds
    becomes the execution time limit, overriding the task's."""
    if not headers:
        return
    if headers.get(h.CLASS):
        headers[h.MSG] = uuid.uuid4().hex
    timeout = headers.get("ext_ml_timeout_seconds")
    if isinstance(timeout, int) and timeout > 0:
        headers["timelimit"] = (timeout, None)


def _record_pending(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """`before_task_publish`: the router found no live worker; record why the job waits."""
    plugin = getattr(_ROUTED, "plugin", None)
    if plugin is None:
        return
    _ROUTED.plugin = None
    if headers and headers.get(h.PENDING):
        plugin.mark_pending(headers)
