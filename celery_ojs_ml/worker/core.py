"""Worker side: capabilities, capacity-driven subscription and the dispatch gate.

Key decisions (research/celery-internals.md §1-§4):
* One consumer bootstep owns everything per consumer (never process-wide):
  queues are added and cancelled on the consumer's own task consumer and
  reapplied in `start()`, which also runs after every reconnect.
* The gate wraps `consumer.on_task_request` in the step's `__init__`, before
  strategies capture it. It allocates devices in the main process, hands them
  to the child in `request_dict`, and frees them from instance-level
  `on_success`/`on_failure`/`on_timeout` wrappers keyed by the Request object.
* A worker consumes a (class, band) queue only while the class fits its free
  capacity, so it never hoards jobs another worker could start now.
* All gate state is guarded by one re-entrant lock: under prefork everything
  runs on the event loop anyway, but under the threads pool (and the embedded
  demo) completions arrive on pool threads and timers on the timer thread.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import click
from celery import Celery, bootsteps, signals

from celery_ojs_ml.allocator import Allocator
from celery_ojs_ml.capabilities import Capabilities, capabilities_to_dict
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.leader.loop import send_wake
from celery_ojs_ml.leader.process import start_candidate
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.store import broker as redis_intake
from celery_ojs_ml.store.leases import LeaseBook, LeaseWriter
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.reservations import ReservationBook
from celery_ojs_ml.wire.inbound import Admission
from celery_ojs_ml.wire.queues import intake_name, worker_queue_name
from celery_ojs_ml.worker.advertising import Advertising
from celery_ojs_ml.worker.gangs import primary_address
from celery_ojs_ml.worker.preemption import Preemptions
from celery_ojs_ml.worker.setup import (
    _child_init,
    _child_postrun,
    _child_prerun,
    plain_running,
    pool_processes,
)
from celery_ojs_ml.worker.setup import capabilities_for as capabilities_for
from celery_ojs_ml.worker.setup import (
    configure_child_recycling as configure_child_recycling,
)
from celery_ojs_ml.worker.setup import is_prefork as is_prefork
from celery_ojs_ml.worker.setup import nvlink_peers_for as nvlink_peers_for

log = logging.getLogger(__name__)
GATES: dict[str, MLWorker] = {}


def install(app: Celery) -> None:
    """Register the worker option, the consumer bootstep and the child hooks."""
    app.user_options["worker"].add(
        click.Option(
            ["--ojs-ml-capabilities"],
            default=None,
            help="auto | PATH | JSON | profile:NAME (default: $OJS_ML_CAPABILITIES or auto).",
        )
    )
    app.steps["consumer"].add(MLWorker)
    signals.task_prerun.connect(_child_prerun, weak=False)  # pins the devices
    signals.task_postrun.connect(_child_postrun, weak=False)  # unpins; stores gang ranks
    signals.celeryd_init.connect(configure_child_recycling, weak=False)
    signals.worker_process_init.connect(_child_init, weak=False)
    from celery_ojs_ml.worker import control  # noqa: F401  (registers the commands)


class MLWorker(Advertising, bootsteps.StartStopStep):  # type: ignore[misc]
    """Capabilities, advertisement, subscription and the gate of one consumer."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    label = "ojs-ml"

    def __init__(self, c: Any, ojs_ml_capabilities: str | None = None, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.c = c
        self.app = c.app
        self.settings = self.app.ojs_ml.settings
        self.bounds = self.settings.parse_options().bounds
        self.admission = Admission(self.bounds, self.settings.max_header_bytes)
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
        self.preemptions = Preemptions(self)
        self.hold_until: dict[Any, float] = {}
        self._wanted: dict[Any, frozenset[str]] = {}
        self._declared: set[str] = set()
        self._bound: dict[str, Any] = {}
        self._pump_due = False
        self.hostname = str(c.hostname)
        self.subscribed: set[str] = set()
        self.classes: dict[str, tuple[MLRequirements, list[tuple[str, str]]]] = {}
        """class id -> (requirements, the (logical queue, band) routes it was published on)."""
        self.version = -1
        self._bad_classes: set[str] = set()
        self.logical: frozenset[str] = frozenset()
        """The worker's own (non-ML) queues: it takes ML jobs of these logical queues only."""
        self.lock = threading.RLock()
        self.incarnation = uuid.uuid4().hex
        self.tokens: dict[Any, str] = {}
        self.fenced: set[Any] = set()
        """Requests whose lease another worker took over; their copy is being stopped."""
        self.stopping: set[Any] = set()
        """Gang ranks being stopped because a peer of their placement failed (`gangs`)."""
        self.unacked: dict[Any, bool] = {}
        """Running requests whose lease write failed: their message is acked when they end."""
        self._timers: list[Any] = []
        self.own_queue = worker_queue_name(self.settings.store_prefix, self.hostname)
        self.address = self.settings.advertise_address or primary_address()
        """MASTER_ADDR for gangs whose rank 0 runs here (`ojs_ml_advertise_address`)."""
        self.scheduler: Any = None
        """The scheduler candidate: a `FleetScheduler` thread or a `CandidateProcess`."""
        self._wake_due = False
        self._caps_doc: dict[str, Any] | None = None
        self._plain_advertised = 0
        self._wake_list: str | None = None
        self.router: Any = None
        """The warm-children router (`warm_pool.Router`); None where it does not run."""
        self.devices_by_id: dict[str, tuple[int, ...]] = {}
        self._requests: dict[str, Any] = {}
        self.child_models: dict[int, dict[str, Any]] = {}
        """Pool child pid -> {devices, models} it holds (`child.models`)."""
        """Devices of each dispatched job, for the router (dropped at release)."""
        self._orig_handler = c.on_task_request
        c.on_task_request = self.on_task_request
        GATES[self.hostname] = self

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
        s = self.settings
        self.store = self.app.ojs_ml.store
        self.book = PendingBook(self.store)
        self.reservations = ReservationBook(self.store)
        self.leases = LeaseBook(self.store, s.lease_ttl_s)
        self.writer = LeaseWriter(
            self.leases,
            self._deferrer(c),
            getattr(c, "hub", None),
            busy_delay_s=s.lease_write_delay_ms / 1000,
        )
        self._wake_list = redis_intake.wake_list(self.app, intake_name(s.store_prefix))
        self.recover_own()
        self.init_grants()
        with self.lock:
            self.version, self._wanted, self._declared, self._bound = -1, {}, set(), {}
            self.subscribed = {q.name for q in c.task_consumer.queues if ".ml." in q.name}
            self.logical = self._own_queues()
            self.refresh()
        self.advertise(wake=self._wake_item())  # a worker joining is capacity for the leader
        self._open_prefetch(c)
        self._start_scheduler()
        self._timers = [
            c.timer.call_repeatedly(s.subscription_poll_s, self.refresh),
            c.timer.call_repeatedly(s.heartbeat_s, self._heartbeat),
            c.timer.call_repeatedly(s.heartbeat_s, self.tend_leases),
            c.timer.call_repeatedly(
                min(0.25, s.max_hold_s / 4, s.grant_wait_s / 4), self.expire_holds
            ),
        ]
        maintain = getattr(c.pool, "maintain_pool", None)
        if self.prefork and self.caps.gpu_count and maintain is not None:
            # Children are recycled after every GPU task; billiard replaces them on its
            # own 5 s timer when an exit is missed, so look more often (cheap when idle).
            self._timers.append(c.timer.call_repeatedly(0.2, maintain))
        self._check_concurrency(getattr(c.pool, "limit", None))
        log.info("ojs-ml: %s", self.banner())

    def _open_prefetch(self, c: Any) -> None:
        """Room in the consumer's QoS for the jobs the leader prefetches (`ojs_ml_prefetch`).

        A running ML job keeps its message unacked until its lease is written
        (`_take_lease`; a short job, until it ends), so with every prefetch slot
        taken by running jobs a prefetched message would only be read once a job
        ended, too late to start without a gap. `c.qos` is new after every
        consumer (re)start, hence here. A grant holder keeps only part of the raise, or
        none (`Granted.sync_prefetch`)."""
        self.c, self.prefetch_raise = c, 0
        self.sync_prefetch()

    def _start_scheduler(self) -> None:
        """Run a candidate for the fleet scheduler lock (`ojs_ml_scheduler`)."""
        if self.settings.scheduler == "off" or self.scheduler is not None:
            return
        thread = self.settings.scheduler == "thread"
        self.scheduler = start_candidate(self.app, self.hostname, thread=thread)

    def wake_scheduler(self) -> None:
        """Capacity was freed or given back: advertise it, then wake the scheduler (coalesced)."""
        hub = getattr(self.c, "hub", None)
        if hub is not None and threading.current_thread() is threading.main_thread():
            if not self._wake_due:
                self._wake_due = True
                hub.call_soon(self._wake_now)
        else:
            self._wake_now()

    def _wake_now(self) -> None:
        self._wake_due = False
        wake = self._wake_item()
        if wake is not None:  # one round trip: advertisement and wake-up
            if threading.current_thread() is not threading.main_thread():
                self.advertise(wake=wake)  # the writer's connection belongs to the loop
                return

            def again() -> None:
                self.advertise(wake=wake)

            self.advertise(wake=wake, send=lambda cmds: self.writer.fire(cmds, again))
            return
        self.advertise()
        try:
            send_wake(self.app, self.hostname)
        except Exception as exc:  # the scheduler also passes on its own interval
            log.warning("ojs-ml: could not wake the scheduler: %s", exc)

    def _heartbeat(self) -> None:
        """The periodic advertisement; one that reports a change in the plain tasks
        running here also wakes the scheduler (`plain_changed`)."""
        if self.plain_changed():
            self._wake_now()
        else:
            self.advertise()
        if self._grants_on:
            self.read_grants()
            self.return_revoked()

    def _wake_item(self) -> tuple[str, bytes] | None:
        """A wake-up for the store's own client (`redis_intake.wake_list`); None where
        it goes through kombu."""
        if self._wake_list is None:
            return None
        return self._wake_list, redis_intake.wake_message(self.hostname)

    def _check_concurrency(self, limit: Any) -> None:
        """Warn when the pool has fewer processes than the worker has GPUs.

        The gate hands out every free GPU, but a job only runs when a pool
        process is free: with `-c 2` on an 8-GPU worker, six jobs would hold
        GPUs while they wait for a process, and other workers could not take
        them.
        """
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

    @staticmethod
    def _deferrer(c: Any) -> Any:
        """Run a lease flush `delay_s` from now on the event loop; None without one.

        The loop hands a dispatched job to its pool child on the poll that
        follows the dispatch, so a flush due a few milliseconds later runs
        after that hand-off: the lease round trip stays off the task's start,
        and every take and release in between share one round trip
        (`leases.LeaseWriter` picks 2 ms on an idle worker, `ojs_ml_lease_write_delay_ms`
        on a busy one).
        A timer (not `call_soon` twice) bounds the delay: the loop may sleep
        in its poll for up to a second before it runs a second `call_soon`.
        """
        hub = getattr(c, "hub", None)
        if hub is None:
            return None
        return lambda fn, delay_s: hub.call_later(delay_s, fn)

    def stop(self, c: Any) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers = []
        writer = getattr(self, "writer", None)
        if writer is not None:
            with self.lock:
                writer.flush(wait=True)
                writer.close()
        with self.lock:
            for pending in self.allocator.held():
                self.allocator.cancel(pending.key)
                self._leave_hold(pending.key)
            self.subscribed = set()

    def shutdown(self, c: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        try:
            self.store.forget_worker(self.hostname)
        except Exception:  # the store may already be gone at shutdown
            log.debug("ojs-ml: could not deregister %s", self.hostname)
        GATES.pop(self.hostname, None)

    def info(self, c: Any) -> dict[str, Any]:
        """Merged into `celery inspect stats`, and so into Flower's worker page."""
        return {"ojs_ml": self.snapshot()}

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
        with self.lock:
            alloc = self.allocator.snapshot()
            return {
                "capabilities": capabilities_to_dict(self.caps)["capabilities"],
                "labels": self.caps.derived_labels(),
                "allocator": alloc,
                "queues": sorted(self.subscribed),
                "pinning": self.prefork,
                "processes": pool_processes(getattr(self, "c", None)),
                "plain_running": plain_running(alloc["allocations"]),
            }
