"""The worker's advertisement (§11) and its queue subscription.

A mixin of `worker.MLWorker`, split out of it to keep modules small; every
attribute below is set by `MLWorker.__init__`/`start`.

Key decisions (see `worker`'s module doc):
* The advertisement is the declared capabilities plus what is live: models
  loaded by pool children (`child.models`), reservations held, the
  allocator's snapshot; it is re-written on every heartbeat.
* Queues are added and cancelled on the consumer's own task consumer and
  reapplied in `start()`, which also runs after every reconnect.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from celery_ojs_ml.allocator import Allocator
from celery_ojs_ml.capabilities import Capabilities, capabilities_to_dict
from celery_ojs_ml.child.models import live_models, merged
from celery_ojs_ml.matching import Verdict, match
from celery_ojs_ml.producer.routing import class_routes, queue_name
from celery_ojs_ml.spec.classes import BANDS, hard_constraints
from celery_ojs_ml.spec.normalize import Bounds, normalize
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.store.reservations import held_by
from celery_ojs_ml.wire.inbound import Admission
from celery_ojs_ml.wire.queues import ml_queue
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker.gate import Gate
from celery_ojs_ml.worker.setup import (
    plain_running,
    pool_processes,
    task_events_on,
)
from celery_ojs_ml.worker.wakeup import wake_consumer
from celery_ojs_ml.worker.warm_pool import pool_pids

log = logging.getLogger("celery_ojs_ml.worker.core")
_WANTED_CACHE = 256
"""Subscription sets cached per (registry version, capacity shape) before the cache resets."""


class Advertising(Gate):
    """What this worker advertises and which queues it consumes (see module doc)."""

    app: Celery
    c: Any
    caps: Capabilities
    settings: OJSMLSettings
    bounds: Bounds
    store: OJSStore
    allocator: Allocator
    admission: Admission
    hostname: str
    address: str
    own_queue: str
    prefork: bool
    lock: threading.RLock
    logical: frozenset[str]
    subscribed: set[str]
    classes: dict[str, tuple[MLRequirements, list[tuple[str, str]]]]
    version: int
    child_models: dict[int, dict[str, Any]]
    reservations: Any
    _wanted: dict[Any, frozenset[str]]
    _declared: set[str]
    _bound: dict[str, Any]
    _bad_classes: set[str]
    _caps_doc: dict[str, Any] | None
    _plain_advertised: int
    """`info.plain_running` as last advertised."""

    def advertise(
        self,
        wake: tuple[str, bytes] | None = None,
        send: Callable[[list[tuple[Any, ...]]], bool] | None = None,
    ) -> None:
        """Heartbeat: capabilities and free capacity into the live-worker registry.

        `wake` (a wake-up's list and message, `redis_intake.wake_list`): capacity
        changed; the wake-up goes in the same round trip, and the capabilities are
        those of the last heartbeat (live models are read again at the next one).
        `send`: sends the writes without waiting for their reply (the lease writer's
        `fire`); when it returns False they are written here and waited for.
        """
        ttl = 3 * self.settings.heartbeat_s
        with self.lock:
            snap = self.allocator.snapshot()
            held = [p.as_dict() for p in self.allocator.held()]
        try:
            if wake is None or self._caps_doc is None:
                self._caps_doc = self._advertised_caps()
            plain = self._plain_advertised = plain_running(snap["allocations"])
            info = {
                "pid": os.getpid(),
                "pinning": self.prefork,
                "queues": sorted(self.logical),
                "address": self.address,
                "task_events": task_events_on(getattr(self, "c", None)),
                "processes": pool_processes(getattr(self, "c", None)),
                "plain_running": plain,
                "granted_started": self.granted_started_at(),
            }
            args = (self.hostname, self._caps_doc, snap)
            kwargs: dict[str, Any] = {"ttl_s": ttl, "info": info, "held": held, "push": wake}
            if send is None or not send(self.store.advertise_commands(*args, **kwargs)):
                self.store.advertise(*args, **kwargs)
        except Exception as exc:  # a store outage must not stop the worker
            log.warning("ojs-ml: advertisement failed: %s", exc)

    def plain_changed(self) -> bool:
        """Whether the plain Celery tasks running here changed since the last advertisement.

        No release reports them, and a leader deciding an arrival on the fleet its
        last quiet pass read (`lane`) would not see the heartbeat that does: the
        heartbeat that carries a change wakes the leader (seen in CI)."""
        with self.lock:
            allocations = self.allocator.snapshot()["allocations"]
        return plain_running(allocations) != self._plain_advertised

    def _advertised_caps(self) -> dict[str, Any]:
        """The capabilities with `models_loaded` as the pool children hold them now (§11)."""
        doc = capabilities_to_dict(self.caps)
        if not self.prefork:
            return doc
        try:
            self.child_models = live_models(self.store, self.hostname, pool_pids(self.c))
        except Exception as exc:
            log.debug("ojs-ml: could not read the loaded models: %s", exc)
            return doc
        static = doc["capabilities"].get("models_loaded") or []
        if self.child_models:
            doc["capabilities"]["models_loaded"] = merged(static, self.child_models)
        return doc

    def _holds_model(self, ml: MLRequirements) -> Any:
        """pid -> whether that child holds the job's model (for the gate's device choice)."""
        want = (ml.ext_ml_model_id, ml.ext_ml_model_version)
        if not want[0] or not self.child_models:
            return None

        def holds(pid: int) -> bool:
            models = (self.child_models.get(pid) or {}).get("models") or []
            return any(
                m.get("model_id") == want[0] and want[1] in (None, m.get("model_version"))
                for m in models
            )

        return holds

    def refresh(self) -> None:
        """Pick up new classes and (re)apply the queues that fit free capacity now."""
        try:
            version = self.store.classes_version()
            if version < self.version and self.classes:
                self._restore_registry()  # the store restarted empty: put back what we know
                version = self.store.classes_version()
            if version != self.version:
                classes: dict[str, tuple[MLRequirements, list[tuple[str, str]]]] = {}
                for cid, entry in self.store.classes().items():
                    parsed = self._parse_class(cid, entry)
                    if parsed is not None:
                        classes[cid] = parsed
                with self.lock:
                    self.classes, self.version = classes, version
        except Exception as exc:
            log.warning("ojs-ml: could not read the class registry: %s", exc)
        self.hold_reservations()
        with self.lock:
            own = self._own_queues()
            if own != self.logical:  # `celery control add_consumer/cancel_consumer`
                self.logical, self._wanted = own, {}
        self.resubscribe()

    def hold_reservations(self) -> None:
        """Hold exactly the reservations placed on this worker (§8.3, `allocator.pools`)."""
        try:
            if not self.store.client.exists(self.reservations.key) and not self.allocator.pools:
                return
            held = held_by(
                self.reservations.all(), self.hostname, self.admission.parse, time.time()
            )
        except Exception as exc:  # keep what is held until the store answers again
            log.warning("ojs-ml: could not read the reservations: %s", exc)
            return
        with self.lock:
            before = set(self.allocator.pools)
            self.allocator.set_pools(held)
        if set(held) != before:
            log.info("ojs-ml: holding reservations %s", sorted(held) or "none")
        if before - set(held):  # capacity came back: held jobs may fit now
            self.pump()
            self.wake_scheduler()

    def _parse_class(
        self, cid: str, entry: dict[str, Any]
    ) -> tuple[MLRequirements, list[tuple[str, str]]] | None:
        """One registry entry, validated with this app's bounds; None (logged) if it fails.

        A class this worker cannot parse is skipped on its own, so one bad entry
        (a producer with looser bounds, a hand-edited store) never hides the others.
        """
        try:
            return normalize(entry["constraints"], self.bounds).requirements, class_routes(entry)
        except Exception as exc:
            if cid not in self._bad_classes:
                self._bad_classes.add(cid)
                log.error("ojs-ml: skipping requirement class %s: %s", cid, exc)
            return None

    def _restore_registry(self) -> None:
        """Re-register the classes this worker knew after the store lost its registry."""
        log.warning("ojs-ml: the class registry was reset (store restarted?); restoring it")
        for cid, (req, routes) in list(self.classes.items()):
            constraints = hard_constraints(req)
            for logical, band_name in routes:
                self.store.register_class(cid, constraints, logical_queue=logical, band=band_name)

    def _own_queues(self) -> frozenset[str]:
        """The queues this consumer reads besides class queues (`-Q`, `add_consumer`).

        Like plain Celery, a worker runs only the jobs of the queues it was
        told to consume: an ML job of logical queue `train` goes to
        `train.ml.<class>.<band>`, which only workers consuming `train` read.
        """
        tc = self.c.task_consumer
        if tc is None:
            return self.logical
        return frozenset(q.name for q in tc.queues if ".ml." not in q.name)

    def wanted_queues(self) -> set[str]:
        """Class queues of its own logical queues that this worker can run and that fit now.

        Cached on the class registry version and the shape of the allocator's
        state (`Allocator.capacity_key`): on the hot path (dispatch, then
        release) it is asked twice per job, and a worker running alike jobs
        cycles through a handful of shapes, so matching runs only on a miss.
        """
        return set(self._wanted_now())

    def _wanted_now(self) -> frozenset[str]:
        key = (self.version, self.allocator.capacity_key())
        wanted = self._wanted.get(key)
        if wanted is None:
            if len(self._wanted) >= _WANTED_CACHE:
                self._wanted.clear()
            wanted = self._wanted[key] = frozenset(self._compute_wanted())
        return wanted

    def _compute_wanted(self) -> set[str]:
        """The worker's own queue: the fleet scheduler delivers its assignments there."""
        return {self.own_queue}

    def _class_queues(self) -> set[str]:
        """Class queues that fit now (the transport before the fleet scheduler; unused)."""
        free = self.allocator.free_capacity()
        wanted: set[str] = set()
        if self.allocator.held():
            return wanted  # fetch nothing more until the held jobs have started
        room = {b: self.allocator.preemptible_capacity(b) for b in BANDS[:-1]}
        for cid, (req, routes) in self.classes.items():
            fits_now = match(req, self.caps, free).verdict is Verdict.FITS
            for logical, b in routes:
                if logical not in self.logical:
                    continue
                if not fits_now and (
                    b not in room or match(req, self.caps, room[b]).verdict is not Verdict.FITS
                ):
                    continue  # a higher band also comes when preempting lower bands makes room
                wanted.add(queue_name(logical, cid, b))
        return wanted

    def resubscribe(self) -> None:
        """Consume exactly the wanted queues, on this consumer only.

        Before celery's loop has set the consumer's `on_message` (worker start-up),
        queues are only added: the loop's own `consume()` starts them. Consuming
        earlier let an AMQP message arrive while a later bootstep opened a channel,
        for a consumer without callbacks, which stopped the worker
        (`NotImplementedError: Consumer does not have any callbacks`).
        """
        with self.lock:
            tc = self.c.task_consumer
            if tc is None:
                return
            wanted = self._wanted_now()
            if wanted == self.subscribed:
                return
            for name in sorted(self.subscribed - wanted):
                tc.cancel_by_queue(name)
            added = sorted(wanted - self.subscribed)
            for name in added:
                self._add_queue(tc, name)
            started = bool(tc.on_message or tc.callbacks)
            if added and started:
                tc.consume()
            self.subscribed = set(wanted)
        if added and started:
            wake_consumer(tc)

    def _add_queue(self, tc: Any, name: str) -> None:
        """Put the queue `name` back on the consumer `tc` (it starts on `tc.consume()`).

        A worker running alike jobs drops and re-adds the same queue whenever
        its free capacity crosses the class's need, up to twice per job. Each
        queue is declared once per connection (`start` runs again after a
        reconnect) and bound once per channel: the bound `Queue` is kept and
        put back as it is, instead of building and binding a new one (kombu's
        `add_queue` copies the queue and its exchange every time).
        """
        queues = getattr(tc, "_queues", None)
        bound = self._bound.get(name)
        if bound is not None and bound.channel is tc.channel and isinstance(queues, dict):
            queues[name] = bound
            return
        self._bound[name] = tc.add_queue(ml_queue(name, declare=name not in self._declared))
        self._declared.add(name)
