"""Worker side: the consumer bootstep that owns the worker's collaborators.

Key decisions (research/celery-internals.md §1-§4):
* One consumer bootstep per consumer (never process-wide), as Celery's own
  consumer steps are; it builds its collaborators once and only wires them
  (`MLWorker`). They share the per-job state in `running.Running`.
* The gate wraps `consumer.on_task_request` in the step's `__init__`, before
  strategies capture it. `start()` opens the collaborators on the store and the
  event loop; it runs again after every reconnect.
* The worker imports no other side: `plugin.py` hands it the pool children's
  state (`setup.PoolChildren`) and the leader candidate's starter (`install`).
"""

from __future__ import annotations

import logging
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import click
from celery import Celery, bootsteps, signals

from celery_ojs_ml import celery_internals as internals
from celery_ojs_ml.allocator import Allocator
from celery_ojs_ml.capabilities import Capabilities, capabilities_to_dict
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.store import broker
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.wire.batch import batching
from celery_ojs_ml.wire.queues import intake_name, worker_queue_name
from celery_ojs_ml.worker.advertising import Advertiser
from celery_ojs_ml.worker.assigned import Assignments
from celery_ojs_ml.worker.batching import Batcher
from celery_ojs_ml.worker.control import GATES as GATES  # importing it registers the commands
from celery_ojs_ml.worker.finished import settle_copy
from celery_ojs_ml.worker.gangs import primary_address
from celery_ojs_ml.worker.gate import Gate
from celery_ojs_ml.worker.granted import Grants
from celery_ojs_ml.worker.lease_keeping import LeaseKeeper
from celery_ojs_ml.worker.pipelining import Pipeline
from celery_ojs_ml.worker.preemption import Preemptions
from celery_ojs_ml.worker.reservations import ReservationHolder
from celery_ojs_ml.worker.run_env import RunEnvCheck
from celery_ojs_ml.worker.running import Running
from celery_ojs_ml.worker.setup import PoolChildren, plain_running
from celery_ojs_ml.worker.setup import capabilities_for as capabilities_for
from celery_ojs_ml.worker.setup import (
    configure_child_recycling as configure_child_recycling,
)
from celery_ojs_ml.worker.setup import is_prefork as is_prefork
from celery_ojs_ml.worker.setup import nvlink_peers_for as nvlink_peers_for
from celery_ojs_ml.worker.stats import flat_stats, started_fields, warm_children
from celery_ojs_ml.worker.stopping import ChildStopper
from celery_ojs_ml.worker.subscription import Subscription
from celery_ojs_ml.worker.warm_pool import Router

log = logging.getLogger(__name__)
StartCandidate = Callable[..., Any]
"""`start_candidate(app, hostname, thread=...)`: a running leader candidate with `stop()`."""


class Wiring:
    """What `plugin.py` hands the worker of the other sides (see module doc)."""

    def __init__(self, children: PoolChildren, start_candidate: StartCandidate | None) -> None:
        self.children, self.start_candidate = children, start_candidate


_WIRING: weakref.WeakKeyDictionary[Celery, Wiring] = weakref.WeakKeyDictionary()


def install(
    app: Celery, *, children: PoolChildren, start_candidate: StartCandidate | None = None
) -> None:
    """Register the worker option, the consumer bootstep, child recycling and the
    control commands. `children`: the pool children's state (`child.hooks.POOL_CHILDREN`);
    `start_candidate`: starts a leader candidate (`leader.process.start_candidate`)."""
    _WIRING[app] = Wiring(children, start_candidate)
    app.user_options["worker"].add(
        click.Option(
            ["--ojs-ml-capabilities"],
            default=None,
            help="auto | PATH | JSON | profile:NAME (default: $OJS_ML_CAPABILITIES or auto).",
        )
    )
    app.steps["consumer"].add(MLWorker)

    def recycling(**kwargs: Any) -> None:
        configure_child_recycling(children=children, **kwargs)

    signals.celeryd_init.connect(recycling, weak=False)


class MLWorker(bootsteps.StartStopStep):  # type: ignore[misc]
    """Capabilities, advertisement, subscription and the gate of one consumer.

    Its collaborators: the gate (`gate`), lease keeping (`lease_keeping`), grants
    (`granted`), assignments (`assigned`), preemption (`preemption`), the advertisement
    and wake-ups (`advertising`), the queues (`subscription`) and reservations
    (`reservations`).
    """

    requires = ("celery.worker.consumer.tasks:Tasks",)
    label = "ojs-ml"

    def __init__(self, c: Any, ojs_ml_capabilities: str | None = None, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.c, self.app = c, c.app
        self.wiring = _WIRING.get(self.app)
        self.settings = self.app.ojs_ml.settings
        self.caps: Capabilities = capabilities_for(ojs_ml_capabilities)
        if self.settings.model_registry_access and not self.caps.model_registry_access:
            self.caps = self.caps.model_copy(update={"model_registry_access": True})
        self.prefork = is_prefork(getattr(c, "pool", None))
        self._check_pool()
        self.allocator = Allocator(
            self.caps,
            allow_on_demand_preemption=self.settings.allow_on_demand_preemption,
            gpu_sharing=self.settings.gpu_sharing != "off",
            nvlink_peers=nvlink_peers_for(ojs_ml_capabilities, self.caps),
        )
        self.hostname = str(c.hostname)
        self.running = Running()
        self.scheduler: Any = None
        """The leader candidate (`install(start_candidate=...)`), once started."""
        self._timers: list[Any] = []
        self._build()
        GATES[self.hostname] = self

    def _build(self) -> None:
        """The collaborators, each given what it uses."""
        s, c, running, lock = self.settings, self.c, self.running, self.running.lock
        admission = RunEnvCheck(s.parse_options().bounds, s.max_header_bytes, prefork=self.prefork)
        self.stopper = ChildStopper(c, self.prefork, running)
        self.preemptions = Preemptions(
            self.app, c, s, self.allocator, self.stopper.kill_child, self.prefork
        )
        self.preemptions.forsake = running.forsake
        self.leases = LeaseKeeper(
            self.app, s, self.allocator, running, self.preemptions, self.stopper,
            self.hostname, uuid.uuid4().hex,
        )  # fmt: skip
        self.grants = Grants(self.app, c, s, self.hostname, self.allocator, running, self.caps)
        address = s.advertise_address or primary_address()  # MASTER_ADDR of gangs led here
        self.advertiser = Advertiser(
            self.app, c, s, self.caps, self.allocator, lock, self.hostname, address, self.prefork
        )
        self.subscription = Subscription(c, lock, worker_queue_name(s.store_prefix, self.hostname))
        self.advertiser.logical = lambda: self.subscription.logical
        self.advertiser.granted_started_at = self.grants.granted_started_at
        self.assignments = Assignments(
            self.hostname, s, self.allocator, running, self.preemptions,
            self.advertiser.wake_scheduler,
        )  # fmt: skip
        self.assignments.finished = lambda req: settle_copy(self.app, self.store, req)
        self.assignments.to_intake = self.grants.give_back_granted
        self.assignments.later = c.timer.call_after
        self.reservations = ReservationHolder(
            self.hostname, self.allocator, lock, admission.parse, self._capacity_back
        )
        self.gate = Gate(
            c, s, self.caps, admission, self.allocator, running,
            hostname=self.hostname, prefork=self.prefork, preemptions=self.preemptions,
            grants=self.grants, assignments=self.assignments, leases=self.leases,
            resubscribe=self.subscription.resubscribe, hold_reservations=self.reservations.hold,
            wake_scheduler=self.advertiser.wake_scheduler,
            holds_model=self.advertiser.holds_model,
        )  # fmt: skip
        self.batching = Batcher.for_gate(self.gate, running, self.assignments, self.leases)

    def _check_pool(self) -> None:
        if self.prefork or not self.caps.gpu_count:
            return
        message = (
            "the worker pool is not prefork, so CUDA_VISIBLE_DEVICES (process-wide) cannot "
            "pin GPUs per task; tasks get their devices in self.request.ojs_devices instead. "
            "Run the worker with --pool prefork for pinning"
        )
        if self.settings.require_pinning:
            raise ConfigError(f"ojs_ml_require_pinning is True but {message}")
        log.warning("ojs-ml: %s", message)

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, c: Any) -> None:
        self._open(c)
        self.leases.recover_own()
        self.grants.open(self.store)
        self.subscription.open(c)
        self.refresh()
        wake = self.advertiser.wake_item()
        self.advertiser.advertise(wake=wake)  # a worker joining is capacity for the leader
        self.grants.open_prefetch(c)
        self.batching.open(c)  # the consumer reads ahead for batches to fill
        internals.add_task_started_fields(c, started_fields(self.running, self.allocator))
        self._start_scheduler()
        self._start_timers(c)
        self._check_concurrency(getattr(c.pool, "limit", None))
        log.info("ojs-ml: %s", self.banner())

    def _open(self, c: Any) -> None:
        """The store, and the lease writer on this event loop, for every collaborator."""
        store = self.store = self.app.ojs_ml.store
        hub = getattr(c, "hub", None)
        self.leases.open(store, _deferrer(hub), hub)
        self.gate.store = store
        leases = self.leases
        self.assignments.open(PendingBook(store), lambda task_id: leases.leases.get(task_id))
        self.reservations.open(store)
        wake_list = broker.wake_list(self.app, intake_name(self.settings.store_prefix))
        self.advertiser.open(
            store, wake_list, lambda cmds, again: self.leases.writer.fire(cmds, again)
        )

    def _start_timers(self, c: Any) -> None:
        s = self.settings
        self._timers = [
            c.timer.call_repeatedly(s.subscription_poll_s, self.refresh),
            c.timer.call_repeatedly(s.heartbeat_s, self._heartbeat),
            c.timer.call_repeatedly(s.heartbeat_s, self.leases.tend_leases),
            c.timer.call_repeatedly(
                min(0.25, s.max_hold_s / 4, s.grant_wait_s / 4), self.gate.expire_holds
            ),
        ]
        maintain = internals.maintain_pool(c)
        if self.prefork and self.caps.gpu_count and maintain is not None:
            # Children are recycled after every GPU task; billiard replaces them on its
            # own 5 s timer when an exit is missed, so look more often (cheap when idle).
            self._timers.append(c.timer.call_repeatedly(0.2, maintain))

    def _start_scheduler(self) -> None:
        """Run a candidate for the fleet scheduler lock (`ojs_ml_scheduler`)."""
        start = self.wiring.start_candidate if self.wiring is not None else None
        if self.settings.scheduler == "off" or self.scheduler is not None or start is None:
            return
        thread = self.settings.scheduler == "thread"
        self.scheduler = start(self.app, self.hostname, thread=thread)

    def refresh(self) -> None:
        """The subscription poll: reservations placed here, then the queues."""
        self.reservations.hold()
        self.subscription.refresh()

    def _capacity_back(self) -> None:
        """A reservation gave capacity back: held jobs may fit now."""
        self.gate.pump()
        self.advertiser.wake_scheduler()

    def _heartbeat(self) -> None:
        """The periodic advertisement; one that reports a change in the plain tasks
        running here also wakes the scheduler (`plain_changed`)."""
        if self.advertiser.plain_changed():
            self.advertiser.wake_now()
        else:
            self.advertiser.advertise()
        if self.grants.on:
            self.grants.read_grants()
            self.grants.return_revoked()
        self._keep_candidate()

    def _keep_candidate(self) -> None:
        """Start the scheduler candidate again when its process died (killed, out of
        memory): else this worker would stand for election no more, and a fleet whose
        candidates all died would have no scheduler."""
        proc = getattr(self.scheduler, "proc", None)
        if proc is None or proc.is_alive():
            return
        log.warning(
            "ojs-ml: the scheduler candidate (pid %s) ended (exit code %s); starting another",
            *(proc.pid, proc.exitcode),
        )
        self.scheduler = None
        self._start_scheduler()

    def register_with_event_loop(self, c: Any, hub: Any) -> None:
        """After the pool wrote its handlers into the hub, before the loop starts (and again
        on every consumer restart): wrap the pool's write scheduler (`warm_pool`)."""
        children = self.wiring.children if self.wiring is not None else None
        if children is not None and children.mode() == "warm" and self.prefork:
            gate = self.gate
            gate.router = Router.install(c, gate.devices_by_id.get, gate.move, children.table())
            gate.pipeline = self._pipeline(gate.router)

    def _pipeline(self, router: Router | None) -> Pipeline | None:
        """Jobs written behind a running job with the same needs (`ojs_ml_pipeline`)."""
        if router is None or not self.settings.pipeline:
            return None
        gate = self.gate
        batched = gate.batching.options if gate.batching is not None else (lambda req: None)
        return Pipeline(
            self.settings,
            gate.allocator,
            gate.running,
            gate.preemptions,
            router=router,
            requirements=lambda req: gate.preemptions.cap(
                gate.admission.parse(req.request_dict), req.request_dict
            ),
            batched=lambda req: batching(batched(req)),
        )

    def _check_concurrency(self, limit: Any) -> None:
        """Warn when the pool has fewer processes than the worker has GPUs: the gate hands
        out every free GPU, but a job only runs when a pool process is free, so jobs
        beyond the processes would hold GPUs other workers could use."""
        gpus = self.caps.gpu_count
        if gpus and isinstance(limit, int) and 0 < limit < gpus:
            log.warning(
                "ojs-ml: this worker has %d GPUs but %d pool processes; jobs beyond %d hold "
                "GPUs while they wait for a process. Start it with -c %d (or more) to run a "
                "job on every GPU",
                gpus,
                limit,
                limit,
                gpus,
            )

    def stop(self, c: Any) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers = []
        self.leases.close()
        with self.running.lock:
            for pending in self.allocator.held():
                self.allocator.cancel(pending.key)
                self.gate.leave_hold(pending.key)
        self.batching.close()
        self.subscription.close()

    def shutdown(self, c: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        try:
            self.app.ojs_ml.store.forget_worker(self.hostname)
        except Exception:  # the store may already be gone at shutdown
            log.debug("ojs-ml: could not deregister %s", self.hostname)
        GATES.pop(self.hostname, None)

    def info(self, c: Any) -> dict[str, Any]:
        """Merged into `celery inspect stats`, and so into Flower's worker page: flat
        `ojs_ml.*` pairs (`stats`); the nested document is `ojs_ml_status`."""
        leader = bool(getattr(self.scheduler, "leading", False))
        return flat_stats(self.snapshot(), leader=leader, warm=warm_children(self.gate.router))

    def banner(self) -> str:
        """One line describing the worker for logs."""
        labels = self.caps.derived_labels()
        gpus = (
            f"{self.caps.gpu_count}x {labels.get('gpu_type', 'gpu')}"
            if self.caps.gpu_count
            else "no GPU"
        )
        pinning = "CUDA_VISIBLE_DEVICES per task" if self.prefork else "off (request.ojs_devices)"
        return f"{self.hostname}: {labels.get('accelerator')} worker, {gpus}, pinning {pinning}"

    def snapshot(self) -> dict[str, Any]:
        """Capabilities, free capacity, allocations, held jobs, subscribed queues, the
        pool's processes and the plain Celery tasks running in it."""
        with self.running.lock:
            alloc = self.allocator.snapshot()
            return {
                "capabilities": capabilities_to_dict(self.caps)["capabilities"],
                "labels": self.caps.derived_labels(),
                "allocator": alloc,
                "queues": sorted(self.subscription.subscribed),
                "pinning": self.prefork,
                "processes": internals.pool_processes(self.c),
                "plain_running": plain_running(alloc["allocations"]),
            }


def _deferrer(hub: Any) -> Any:
    """Run a lease flush `delay_s` from now on the event loop; None without one.

    The loop hands a dispatched job to its pool child on the poll that follows
    the dispatch, so a flush due a few milliseconds later runs after that
    hand-off: the lease round trip stays off the task's start, and every take
    and release in between share one round trip (`leases.LeaseWriter`). A timer
    (not `call_soon` twice) bounds the delay: the loop may sleep in its poll for
    up to a second before it runs a second `call_soon`.
    """
    if hub is None:
        return None
    return lambda fn, delay_s: hub.call_later(delay_s, fn)
