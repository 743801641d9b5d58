"""The worker's advertisement (§11) and the leader's wake-up.

Key decisions:
* The advertisement is the declared capabilities plus what is live: models
  loaded by pool children (a store record they write, `live_models`),
  reservations held, the allocator's snapshot; it is re-written on every
  heartbeat. It names the tasks here that batch their requests
  (`info.batching`): a leader whose process never imported one still sees it.
* Capacity freed or given back is advertised, then the leader is woken; both
  go in one round trip where the store is the broker's Redis (`broker.wake_list`),
  and wake-ups of one event-loop turn are coalesced into one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from celery import Celery

from celery_ojs_ml import celery_internals as internals
from celery_ojs_ml.allocator import Allocator
from celery_ojs_ml.capabilities import Capabilities, capabilities_to_dict
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.store import broker
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.batch import ADVERTISED, batching_tasks
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker.setup import plain_running

log = logging.getLogger("celery_ojs_ml.worker.core")
Fire = Callable[[list[tuple[Any, ...]], Callable[[], None]], bool]
"""The lease writer's `fire(commands, again)`: sends without waiting for the reply."""


class Advertiser:
    """What this worker advertises, and its wake-ups of the leader (see module doc)."""

    def __init__(
        self,
        app: Celery,
        consumer: Any,
        settings: OJSMLSettings,
        caps: Capabilities,
        allocator: Allocator,
        lock: threading.RLock,
        hostname: str,
        address: str,
        prefork: bool,
    ) -> None:
        self.app, self.c, self.settings, self.caps = app, consumer, settings, caps
        self.allocator, self.lock, self.hostname, self.address = allocator, lock, hostname, address
        self.prefork = prefork
        self.store: OJSStore = None  # type: ignore[assignment]
        self.fire: Fire | None = None
        self.logical: Callable[[], Iterable[str]] = frozenset
        self.granted_started_at: Callable[[], float | None] = lambda: None
        self.child_models: dict[int, dict[str, Any]] = {}
        """Pool child pid -> {devices, models} it holds (`child.models`)."""
        self._caps_doc: dict[str, Any] | None = None
        self._plain_advertised = 0
        """`info.plain_running` as last advertised."""
        self._batching: tuple[int, list[str]] = (-1, [])
        """`info.batching`, and the size of the task registry it was read from."""
        self._wake_list: str | None = None
        self._wake_due = False

    def open(self, store: OJSStore, wake_list: str | None, fire: Fire) -> None:
        """At every consumer start: the store, the intake list wake-ups go to, and the
        lease writer's `fire` (its connection belongs to the event loop)."""
        self.store, self._wake_list, self.fire = store, wake_list, fire

    def advertise(
        self,
        wake: tuple[str, bytes] | None = None,
        send: Callable[[list[tuple[Any, ...]]], bool] | None = None,
    ) -> None:
        """Heartbeat: capabilities and free capacity into the live-worker registry.

        `wake` (a wake-up's list and message, `broker.wake_list`): capacity
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
                "queues": sorted(self.logical()),
                "address": self.address,
                "task_events": internals.task_events_on(self.c),
                "processes": internals.pool_processes(self.c),
                "plain_running": plain,
                "granted_started": self.granted_started_at(),
                ADVERTISED: self.batching(),
            }
            args = (self.hostname, self._caps_doc, snap)
            kwargs: dict[str, Any] = {"ttl_s": ttl, "info": info, "held": held, "push": wake}
            if not self._sent(send, args, kwargs):
                self.store.advertise(*args, **kwargs)
        except Exception as exc:  # a store outage must not stop the worker
            log.warning("ojs-ml: advertisement failed: %s", exc)

    def _sent(
        self,
        send: Callable[[list[tuple[Any, ...]]], bool] | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> bool:
        """Whether `send` took the heartbeat's writes; when it did not, what they queued
        for the heartbeat feed is forgotten, so the write that follows queues it again."""
        if send is None:
            return False
        if send(self.store.advertise_commands(*args, **kwargs)):
            return True
        self.store.advertise_failed(self.hostname)
        return False

    def batching(self) -> list[str]:
        """The sorted names of this worker's tasks that batch their requests
        (`wire.batch.batching_tasks`), read again only when its task registry's size
        changed: a task defined later (a lazy import) adds one."""
        tasks = self.app.tasks
        if self._batching[0] != len(tasks):
            self._batching = (len(tasks), batching_tasks(tasks))
        return self._batching[1]

    def plain_changed(self) -> bool:
        """Whether the plain Celery tasks running here changed since the last advertisement.

        No release reports them, and a leader deciding an arrival on the fleet its
        last quiet pass read would not see the heartbeat that does: the heartbeat
        that carries a change wakes the leader."""
        with self.lock:
            allocations = self.allocator.snapshot()["allocations"]
        return plain_running(allocations) != self._plain_advertised

    def _advertised_caps(self) -> dict[str, Any]:
        """The capabilities with `models_loaded` as the pool children hold them now (§11)."""
        doc = capabilities_to_dict(self.caps)
        if not self.prefork:
            return doc
        try:
            pids = internals.pool_pids(self.c)
            self.child_models = live_models(self.store, self.hostname, pids)
        except Exception as exc:
            log.debug("ojs-ml: could not read the loaded models: %s", exc)
            return doc
        static = doc["capabilities"].get("models_loaded") or []
        if self.child_models:
            doc["capabilities"]["models_loaded"] = merged(static, self.child_models)
        return doc

    def holds_model(self, ml: MLRequirements) -> Any:
        """pid -> whether that child holds the job's model (for the gate's device choice)."""
        want = (ml.ext_ml_model_id, ml.ext_ml_model_version)
        if not want[0] or not self.child_models:
            return None
        child_models = self.child_models

        def holds(pid: int) -> bool:
            models = (child_models.get(pid) or {}).get("models") or []
            return any(
                m.get("model_id") == want[0] and want[1] in (None, m.get("model_version"))
                for m in models
            )

        return holds

    def wake_scheduler(self) -> None:
        """Capacity was freed or given back: advertise it, then wake the scheduler (coalesced)."""
        hub = getattr(self.c, "hub", None)
        if hub is not None and threading.current_thread() is threading.main_thread():
            if not self._wake_due:
                self._wake_due = True
                hub.call_soon(self.wake_now)
        else:
            self.wake_now()

    def wake_now(self) -> None:
        """Advertise, and wake the scheduler, now."""
        self._wake_due = False
        wake = self.wake_item()
        if wake is not None:  # one round trip: advertisement and wake-up
            if threading.current_thread() is not threading.main_thread() or self.fire is None:
                self.advertise(wake=wake)  # the writer's connection belongs to the loop
                return
            fire = self.fire

            def again() -> None:
                self.store.advertise_failed(self.hostname)
                self.advertise(wake=wake)

            self.advertise(wake=wake, send=lambda cmds: fire(cmds, again))
            return
        self.advertise()
        try:
            broker.send_wake(self.app, self.hostname)
        except Exception as exc:  # the scheduler also passes on its own interval
            log.warning("ojs-ml: could not wake the scheduler: %s", exc)

    def wake_item(self) -> tuple[str, bytes] | None:
        """A wake-up for the store's own client (`broker.wake_list`); None where it goes
        through kombu."""
        if self._wake_list is None:
            return None
        return self._wake_list, broker.wake_message(self.hostname)


def live_models(store: Any, worker: str, alive: Iterable[int]) -> dict[int, dict[str, Any]]:
    """Each live child's entry in the store (pid -> {devices, models}, which the child
    writes: `child.models.publish`); entries of gone pids are dropped."""
    key = store.key("models", worker)
    found: dict[int, dict[str, Any]] = {}
    stale = []
    pids = set(alive)
    for pid, raw in store.client.hgetall(key).items():
        try:
            n, entry = int(pid), json.loads(raw)
        except (TypeError, ValueError):
            stale.append(pid)
            continue
        if n in pids and isinstance(entry, dict):
            found[n] = entry
        else:
            stale.append(pid)
    if stale:
        store.client.hdel(key, *stale)
    return found


def merged(
    static: Iterable[Mapping[str, Any]], live: Mapping[int, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """`models_loaded`: the static ones, then the live ones, each once."""
    out: list[dict[str, Any]] = []
    seen = set()
    for m in [*static, *(m for e in live.values() for m in e.get("models") or [])]:
        ident = (m.get("model_id"), m.get("model_version"))
        if ident[0] and ident not in seen:
            seen.add(ident)
            out.append(dict(m))
    return out
