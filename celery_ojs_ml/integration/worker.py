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
import os
import signal
import threading
import time
import uuid
from typing import Any

import click
from billiard.exceptions import Terminated
from celery import Celery, bootsteps, signals
from celery.exceptions import Ignore, Reject, Retry
from celery.worker import state as worker_state

from celery_ojs_ml.allocator import Allocation, Allocator, Denied, Pending
from celery_ojs_ml.capabilities import Capabilities, capabilities_to_dict, resolve_capabilities
from celery_ojs_ml.capabilities.probe import visible_tokens
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.integration import assigned, child, warm_pool
from celery_ojs_ml.integration.admission import Admission, BadMessage
from celery_ojs_ml.integration.deadletter import dead_letter, last_checkpoint_of
from celery_ojs_ml.integration.gangs import (
    HEADER_RENDEZVOUS,
    gang_crash,
    give_up_rank,
    primary_address,
    requeue_rank,
    store_rank_result,
)
from celery_ojs_ml.integration.labels import job_labels
from celery_ojs_ml.integration.leases import LeaseBook, LeaseWriter, republish_headers
from celery_ojs_ml.integration.models import live_models, merged
from celery_ojs_ml.integration.preemption import Preemptions
from celery_ojs_ml.integration.reservations import ReservationBook, held_by
from celery_ojs_ml.integration.routing import (
    HEADER_PENDING,
    class_routes,
    ml_queue,
    queue_name,
)
from celery_ojs_ml.integration.scheduler_process import start_candidate
from celery_ojs_ml.integration.scheduling import HEADER_PREFETCH, send_wake, worker_queue_name
from celery_ojs_ml.integration.sharing import HEADER_SHARE, share_info
from celery_ojs_ml.integration.wakeup import wake_consumer
from celery_ojs_ml.integration.warm_pool import pool_pids
from celery_ojs_ml.lru import LRU
from celery_ojs_ml.matching import Verdict, match
from celery_ojs_ml.pending import PendingBook
from celery_ojs_ml.spec.classes import BANDS, hard_constraints
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import MLRequirements

log = logging.getLogger(__name__)
GATES: dict[str, MLWorker] = {}
_CAPS_CACHE: LRU[str | None, Capabilities] = LRU(16)
_WANTED_CACHE = 256
"""Subscription sets cached per (registry version, capacity shape) before the cache resets."""


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
    signals.task_prerun.connect(child.pin_devices, weak=False)
    signals.task_postrun.connect(child.unpin_devices, weak=False)
    signals.task_postrun.connect(_child_postrun, weak=False)
    signals.task_success.connect(store_rank_result, weak=False)
    signals.celeryd_init.connect(configure_child_recycling, weak=False)
    signals.worker_process_init.connect(_child_init, weak=False)
    signals.task_prerun.connect(_child_prerun, weak=False)
    from celery_ojs_ml.integration import control  # noqa: F401  (registers the commands)


def capabilities_for(value: str | None) -> Capabilities:
    """Resolve `--ojs-ml-capabilities` once per process (the probe is not free)."""
    caps = _CAPS_CACHE.get(value)
    if caps is None:
        caps = _CAPS_CACHE[value] = resolve_capabilities(value)
    return caps


def is_prefork(pool: Any) -> bool:
    """Whether a pool (class, instance or name) is billiard's prefork pool."""
    if pool is None:
        return False
    if isinstance(pool, str):
        return pool in ("prefork", "processes")
    return "prefork" in (getattr(pool, "__module__", "") or "")


def configure_child_recycling(
    sender: Any = None,
    conf: Any = None,
    options: Any = None,
    instance: Any = None,
    **_: Any,
) -> None:
    """`celeryd_init`: make sure no pool child reuses CUDA bound to other devices.

    CUDA binds `CUDA_VISIBLE_DEVICES` when a process first initialises it.
    `ojs_ml_recycle_gpu_children`:
    * "cuda" (default): a child is retired after any task that left the CUDA
      driver loaded in it (`child.install_cuda_retirement`); others are reused.
    * "always": `worker_max_tasks_per_child=1`, one task per child.
    * "never": children are reused; only safe when tasks never initialise CUDA.
    """
    app = getattr(instance, "app", None) or getattr(sender, "app", None)
    options = options or {}
    plugin = getattr(app, "ojs_ml", None) if app is not None else None
    mode = plugin.settings.recycle_gpu_children if plugin is not None else "cuda"
    caps = capabilities_for(options.get("ojs_ml_capabilities"))
    pool = options.get("pool_cls") or (conf.worker_pool if conf is not None else None)
    child.RECYCLE["mode"] = "never"
    child.VISIBLE["tokens"] = visible_tokens()
    if child.VISIBLE["tokens"] is not None and len(child.VISIBLE["tokens"]) < caps.gpu_count:
        log.error(
            "ojs-ml: the worker has %d GPUs but CUDA_VISIBLE_DEVICES names %d; tasks on the "
            "others get no device. Start it with as many visible devices as it advertises",
            caps.gpu_count,
            len(child.VISIBLE["tokens"] or []),
        )
    if mode == "never" or not (caps.gpu_count and is_prefork(pool) and conf is not None):
        return
    if mode == "warm" and warm_pool.missing_internals():
        log.warning(
            "ojs-ml: warm children need celery internals that changed (%s); retiring CUDA "
            "children instead",
            warm_pool.missing_internals(),
        )
        mode = "cuda"
    if mode == "cuda" and not child.billiard_can_retire():
        log.warning("ojs-ml: this billiard cannot retire CUDA children; one task per child")
        mode = "always"
    child.RECYCLE["mode"] = mode
    if mode == "warm":
        warm_pool.make_table()  # before the pool forks: children inherit it
        return
    if mode == "cuda":
        if not (options.get("max_memory_per_child") or conf.worker_max_memory_per_child):
            conf.worker_max_memory_per_child = child.NO_LIMIT_KB
        return
    given = options.get("max_tasks_per_child") or conf.worker_max_tasks_per_child
    if given not in (None, 1):
        log.warning(
            "ojs-ml: worker_max_tasks_per_child=%s on a GPU worker; forcing 1 because "
            'ojs_ml_recycle_gpu_children="always"',
            given,
        )
    conf.worker_max_tasks_per_child = 1


def _child_init(**_: Any) -> None:
    """`worker_process_init`: the preemption flag on SIGUSR2, and CUDA retirement."""
    from celery_ojs_ml.checkpoint import install_child_handler

    install_child_handler()
    if child.RECYCLE["mode"] == "cuda":
        child.install_cuda_retirement()
    if child.RECYCLE["mode"] == "warm":
        warm_pool.reset_slot()
        _WATCH["cuda"] = child.DriverWatch()


def _child_prerun(**_: Any) -> None:
    from celery_ojs_ml.checkpoint import reset_flag

    reset_flag()


_WATCH: dict[str, Any] = {}


def _child_postrun(task: Any = None, **_: Any) -> None:
    """Warm mode: a child records the device set its CUDA came up with (`warm_pool`)."""
    watch = _WATCH.get("cuda")
    if watch is not None:
        devices = getattr(getattr(task, "request", None), "ojs_devices", None)
        warm_pool.bind_after_task(list(devices) if devices else None, watch)


class MLWorker(bootsteps.StartStopStep):  # type: ignore[misc]
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
        self.unacked: dict[Any, bool] = {}
        """Running requests whose lease write failed: their message is acked when they end."""
        self._timers: list[Any] = []
        self.own_queue = worker_queue_name(self.settings.store_prefix, self.hostname)
        self.address = self.settings.advertise_address or primary_address()
        """MASTER_ADDR for gangs whose rank 0 runs here (`ojs_ml_advertise_address`)."""
        self.scheduler: Any = None
        """The scheduler candidate: a `FleetScheduler` thread or a `CandidateProcess`."""
        self._wake_due = False
        self.router: Any = None
        """The warm-children router (`warm_pool.Router`); None where it does not run."""
        self.devices_by_id: dict[str, tuple[int, ...]] = {}
        self._requests: dict[str, Any] = {}
        self.child_models: dict[int, dict[str, Any]] = {}
        """Pool child pid -> {devices, models} it holds (`integration.models`)."""
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
        self.recover_own()
        with self.lock:
            self.version, self._wanted, self._declared, self._bound = -1, {}, set(), {}
            self.subscribed = {q.name for q in c.task_consumer.queues if ".ml." in q.name}
            self.logical = self._own_queues()
            self.refresh()
        self.advertise()
        self._start_scheduler()
        self._timers = [
            c.timer.call_repeatedly(s.subscription_poll_s, self.refresh),
            c.timer.call_repeatedly(s.heartbeat_s, self.advertise),
            c.timer.call_repeatedly(s.heartbeat_s, self.tend_leases),
            c.timer.call_repeatedly(min(1.0, s.max_hold_s / 4), self.expire_holds),
        ]
        maintain = getattr(c.pool, "maintain_pool", None)
        if self.prefork and self.caps.gpu_count and maintain is not None:
            # Children are recycled after every GPU task; billiard replaces them on its
            # own 5 s timer when an exit is missed, so look more often (cheap when idle).
            self._timers.append(c.timer.call_repeatedly(0.2, maintain))
        self._check_concurrency(getattr(c.pool, "limit", None))
        log.info("ojs-ml: %s", self.banner())

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
        self.advertise()
        try:
            send_wake(self.app, self.hostname)
        except Exception as exc:  # the scheduler also passes on its own interval
            log.warning("ojs-ml: could not wake the scheduler: %s", exc)

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
        """Capabilities, free capacity, allocations, held jobs and subscribed queues."""
        with self.lock:
            return {
                "capabilities": capabilities_to_dict(self.caps)["capabilities"],
                "labels": self.caps.derived_labels(),
                "allocator": self.allocator.snapshot(),
                "queues": sorted(self.subscribed),
                "pinning": self.prefork,
            }

    # -- advertisement and subscription -------------------------------------------------------

    def advertise(self) -> None:
        """Heartbeat: capabilities and free capacity into the live-worker registry."""
        ttl = 3 * self.settings.heartbeat_s
        with self.lock:
            snap = self.allocator.snapshot()
            held = [p.as_dict() for p in self.allocator.held()]
        try:
            self.store.advertise(
                self.hostname,
                self._advertised_caps(),
                snap,
                ttl_s=ttl,
                info={
                    "pid": os.getpid(),
                    "pinning": self.prefork,
                    "queues": sorted(self.logical),
                    "address": self.address,
                },
                held=held,
            )
        except Exception as exc:  # a store outage must not stop the worker
            log.warning("ojs-ml: advertisement failed: %s", exc)

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
        """Consume exactly the wanted queues, on this consumer only."""
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
            if added:
                tc.consume()
            self.subscribed = set(wanted)
        if added:
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

    # -- the gate -------------------------------------------------------------------------------

    def on_task_request(self, req: Any) -> Any:
        headers = req.request_dict
        try:
            ml = self.admission.requirements(headers)
        except BadMessage as exc:
            return self.refuse(req, str(exc))
        if ml is None:
            return self._orig_handler(req)
        try:
            return self._gate(req, ml)
        except Exception as exc:  # never out of on_task_received: it would stop the consumer
            log.exception("ojs-ml: the gate failed on %s", req.id)
            with self.lock:
                self.allocator.free(req)
            return self.refuse(req, f"the worker's gate failed: {exc!r}")

    def _gate(self, req: Any, ml: MLRequirements) -> Any:
        headers = req.request_dict
        rid = ml.ext_ml_reservation_id
        if rid is not None and rid not in self.allocator.pools:
            self.hold_reservations()  # placed since the last refresh?
        with self.lock:
            ml = self.preemptions.cap(ml, headers)
            outcome = self.allocator.try_alloc(
                req,
                req.id,
                ml,
                priority=band_priority(headers),
                labels=job_labels(req.name, headers),
                prefer=self._warm_sets(ml),
            )
            if assigned.token_of(req) is not None and not isinstance(outcome, Allocation):
                return self._not_fitting(req, outcome)
            if isinstance(outcome, Pending) and outcome.band != BANDS[-1]:
                grace = self.preemptions.make_room(ml, outcome.band)
                if grace is not None:  # hold it until the victims have yielded or been killed
                    self.hold_until[req] = time.monotonic() + grace + self.settings.max_hold_s
            return self._handle(req, outcome)

    def _warm_sets(self, ml: MLRequirements) -> list[tuple[int, ...]]:
        """Device sets idle warm children are bound to (`warm_pool`), model holders first."""
        return self.router.idle_bound(self._holds_model(ml)) if self.router else []

    def register_with_event_loop(self, c: Any, hub: Any) -> None:
        """After the pool wrote its handlers into the hub, before the loop starts (and again
        on every consumer restart): wrap the pool's write scheduler (`warm_pool`)."""
        if child.RECYCLE["mode"] == "warm" and self.prefork:
            self.router = warm_pool.Router.install(c, self.devices_by_id.get, self._move)

    def _move(self, task_id: str, devices: tuple[int, ...]) -> bool:
        """The router moves a dispatched job onto an idle warm child's devices."""
        with self.lock:
            req = self._requests.get(task_id)
            if req is None or self.allocator.move(req, devices) is None:
                return False
            self.devices_by_id[task_id] = devices
            req.request_dict["ojs_devices"] = list(devices)
        return True

    def _not_fitting(self, req: Any, outcome: Pending | Denied) -> Any:
        """A scheduled job that does not fit: preempt the planned victims, else give it back."""
        if isinstance(outcome, Pending) and req.request_dict.get(HEADER_PREFETCH):
            # delivered ahead of capacity: wait here, start as soon as a job ends
            self.hold_until[req] = time.monotonic() + self.settings.assignment_timeout_s - 1
            return self._handle(req, outcome)
        victims = assigned.victims_of(req)
        grace = assigned.preempt_planned(self, req, victims) if victims else None
        if isinstance(outcome, Pending) and grace is not None:
            self.hold_until[req] = time.monotonic() + grace + self.settings.max_hold_s
            assigned.hold_for_victims(self, req, grace)
            return self._handle(req, outcome)
        assigned.give_back(self, req, outcome.reason)
        return None

    def refuse(self, req: Any, reason: str) -> None:
        """End a message the gate cannot run: dead-letter it with the reason, fail it, drop it.

        The job is kept (`celery ojs-ml dead` lists it, `dead --retry` re-publishes
        it), its caller sees a failure instead of waiting forever, and the
        worker carries on with the next message.
        """
        log.error("ojs-ml: refusing %s[%s]: %s", req.name, req.id, reason)
        headers = republish_headers(req.request_dict)
        if len(repr(headers)) > 2 * self.settings.max_header_bytes:
            headers = {}  # an oversized header is not copied into the store
        record = {
            "task_id": req.id,
            "name": req.name,
            "args": list(req.args),
            "kwargs": dict(req.kwargs),
            "headers": headers,
            "retries": 0,
        }
        for step in (
            lambda: dead_letter(self.store, record, f"refused by {self.hostname}: {reason}"),
            lambda: refused_result(req, reason),
        ):
            try:
                step()
            except Exception as exc:
                log.warning("ojs-ml: while refusing %s: %s", req.id, exc)
        worker_state.task_ready(req)
        req.reject(requeue=False)

    def _handle(self, req: Any, outcome: Allocation | Pending | Denied) -> Any:
        if isinstance(outcome, Allocation):
            return self._dispatch(req, outcome)
        if isinstance(outcome, Pending):
            log.info("ojs-ml: holding %s: %s", req.id, outcome.reason)
            self.allocator.hold(outcome)
            self.c.qos.increment_eventually()
            self.resubscribe()
            return None
        log.warning(
            "ojs-ml: %s cannot run %s here (%s); requeueing", self.hostname, req.id, outcome.reason
        )
        self._requeue(req)
        return None

    def _dispatch(self, req: Any, alloc: Allocation) -> Any:
        if not assigned.may_start(self, req, alloc):
            return None
        log.debug("ojs-ml: dispatch %s on %s", req.id, alloc.devices)
        req.request_dict["ojs_devices"] = list(alloc.devices)
        if alloc.gpu_milli:  # a GPU share: the task reads it in self.request.ojs_gpu_share
            req.request_dict[HEADER_SHARE] = share_info(
                alloc, self.admission.parse(req.request_dict), self.caps
            )
        self.devices_by_id[req.id] = tuple(alloc.devices)
        self._requests[req.id] = req
        req.request_dict["ojs_node"] = self.hostname
        req.request_dict["ojs_pin"] = self.prefork
        if HEADER_RENDEZVOUS in req.request_dict:  # a gang rank's failure re-places its gang:
            req.request_dict["ignore_result"] = True  # no FAILURE stored (see integration.gangs)
        req.on_failure = self._failing(req, req.on_failure)
        for name in ("on_success", "on_failure"):
            setattr(req, name, self._releasing(req, getattr(req, name)))
        req.on_timeout = self._timeout_releasing(req, req.on_timeout)
        if req.request_dict.get(HEADER_PENDING):
            self._clear_pending(req.id)
        self._take_lease(req, alloc)
        self.resubscribe()
        return self._orig_handler(req)

    def _clear_pending(self, task_id: str) -> None:
        try:
            self.store.clear_pending(task_id)
        except Exception as exc:
            log.warning("ojs-ml: could not clear the pending record of %s: %s", task_id, exc)

    def _releasing(self, req: Any, original: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                self.release(req)

        return wrapped

    def _timeout_releasing(self, req: Any, original: Any) -> Any:
        def wrapped(soft: bool, timeout: float) -> Any:
            try:
                return original(soft, timeout)
            finally:
                if not soft:
                    self.release(req)

        return wrapped

    def release(self, req: Any) -> None:
        """Free a finished job's allocation, then start held jobs that now fit."""
        self.preemptions.finished(req)
        self.devices_by_id.pop(req.id, None)
        self._requests.pop(req.id, None)
        with self.lock:
            self.fenced.discard(req)
            if self.allocator.free(req) is None:
                return
            token = self.tokens.pop(req, None)
        if token is not None:
            self.writer.release(req.id, token)
        if self.unacked.pop(req, False):
            self._ack(req)  # its lease could not be written: the message held it
        log.debug("ojs-ml: released %s", req.id)
        self.wake_scheduler()
        hub = getattr(self.c, "hub", None)
        if hub is not None and threading.current_thread() is threading.main_thread():
            if not self._pump_due:  # one pump serves every release of this loop turn
                self._pump_due = True
                hub.call_soon(self.pump)
        else:
            self.pump()

    def pump(self) -> None:
        """Start held jobs that fit now, in band, priority and FIFO order."""
        with self.lock:
            self._pump_due = False
            for alloc in self.allocator.pump():
                req: Any = alloc.key
                self.hold_until.pop(req, None)
                self._leave_hold(req)
                if req.revoked():
                    self.allocator.free(req)
                    continue
                self._dispatch(req, alloc)
            self.resubscribe()

    def _leave_hold(self, req: Any) -> None:
        self.c.qos.decrement_eventually()

    def _requeue(self, req: Any) -> None:
        worker_state.task_ready(req)
        req.reject(requeue=True)

    def expire_holds(self) -> None:
        """Requeue messages held longer than `ojs_ml_max_hold_s` (well below broker timeouts)."""
        with self.lock:
            now = time.monotonic()
            for pending in self.allocator.expired(self.settings.max_hold_s):
                req: Any = pending.key
                if self.hold_until.get(req, 0.0) > now:
                    self.allocator.hold(pending)  # still waiting for its victims to yield
                    continue
                self.hold_until.pop(req, None)
                self._leave_hold(req)
                if assigned.token_of(req) is not None:
                    assigned.give_back(self, req, f"held too long: {pending.reason}")
                    continue
                log.info("ojs-ml: %s held too long (%s); requeueing", req.id, pending.reason)
                self._requeue(req)
            if not self.allocator.held():
                self.resubscribe()

    # -- leases (DESIGN decision 4) -------------------------------------------------------------

    def _job_record(self, req: Any, alloc: Allocation, started_at: float) -> dict[str, Any]:
        headers = req.request_dict
        return {
            "task_id": req.id,
            "name": req.name,
            "args": list(req.args),
            "kwargs": dict(req.kwargs),
            "headers": republish_headers(headers),
            "retries": int(headers.get("retries") or 0),
            "worker": self.hostname,
            "incarnation": self.incarnation,
            "devices": list(alloc.devices),
            "started_at": started_at,
            **({"gpu_milli": alloc.gpu_milli} if alloc.gpu_milli else {}),
        }

    def _take_lease(self, req: Any, alloc: Allocation) -> None:
        """Write the job's lease, then ack its message: from now on the lease holds the job.

        The write may be batched (`LeaseWriter`), so Celery's own ack (at accept)
        is suppressed here and `_lease_written` acks once the lease exists. If
        the lease cannot be written (store down, arguments not JSON), the
        message stays unacked until the job ends, so the broker still holds
        the job. The record is built only when the batch goes out: a job that
        ends before then needs no lease.
        """
        started_at = self.store._clock()
        req.acknowledged = True  # Celery must not ack before the lease is written
        token = self.tokens[req] = self.writer.take(
            req.id,
            lambda: self._job_record(req, alloc, started_at),
            lambda ok: self._lease_written(req, ok),
        )
        req.request_dict["ojs_lease"] = token  # the child's checkpoint commits check it

    def _lease_written(self, req: Any, ok: bool) -> None:
        """The lease of `req` exists (or it ended first): ack; else the message holds it."""
        if ok:
            self._ack(req)
            return
        log.warning("ojs-ml: no lease for %s; its broker message holds it until it ends", req.id)
        self.unacked[req] = True

    def _ack(self, req: Any) -> None:
        """Ack a gate-managed request's message once, past the suppression above."""
        if getattr(req, "_ojs_acked", False):
            return
        req._ojs_acked = True
        req.acknowledged = False
        req.acknowledge()

    def tend_leases(self) -> None:
        """Heartbeat our leases; claim and re-publish jobs whose worker died."""
        try:
            with self.lock:
                self.writer.flush(wait=True)  # queued takes first, or they would look lost
                mine = {
                    req.id: token for req, token in self.tokens.items() if req not in self.unacked
                }
            taken, missing = self.leases.refresh(mine)
            if missing:
                self._lease_missing(set(missing))
            if taken:
                self.fence(set(taken))
            for task_id in self.leases.expired():
                lease = self.leases.claim(task_id, self.hostname, self.incarnation)
                if lease is not None:
                    self.recover(lease, f"its worker {lease.get('worker')} stopped heartbeating")
        except Exception as exc:
            log.warning("ojs-ml: lease upkeep failed: %s", exc)

    def fence(self, task_ids: set[str]) -> None:
        """Stop our copies of jobs whose lease another worker took over (invariant 5).

        A claimer only takes a lease that expired, so this worker stalled for
        longer than `ojs_ml_lease_ttl_s` (a frozen process, a partition from
        the store) and the job was re-published elsewhere. Our copy's child is
        killed at once; the failure path then ends it quietly (no result, no
        event, no re-publish, see `_failing`) and frees its devices. The copy
        that took over is the one that counts.
        """
        with self.lock:
            found = [req for req in self.tokens if req.id in task_ids and req not in self.fenced]
            for req in found:
                self.fenced.add(req)
                self.tokens.pop(req, None)  # no longer ours to refresh or release
                pid = getattr(req, "worker_pid", None)
                log.warning(
                    "ojs-ml: the lease of %s[%s] was taken over by another worker (this one "
                    "stalled longer than ojs_ml_lease_ttl_s); stopping this copy (pid %s)",
                    req.name,
                    req.id,
                    pid,
                )
                if not self.kill_child(pid):
                    log.warning("ojs-ml: a non-prefork pool cannot stop %s; it runs on", req.id)

    def kill_child(self, pid: int | None) -> bool:
        """SIGKILL the pool child `pid` through the pool; False where one task cannot be stopped.

        Only a prefork child can be stopped alone (other pools run tasks in
        this process). Used by fencing and by preemption after the grace period.
        """
        if not self.prefork or not pid or pid == os.getpid():
            return False
        terminate = getattr(self.c.pool, "terminate_job", None)
        if terminate is not None:
            terminate(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return True

    def _lease_missing(self, task_ids: set[str]) -> None:
        """Our lease is gone (store restarted empty, or the job finished elsewhere)."""
        with self.lock:
            found = [(req, tok) for req, tok in self.tokens.items() if req.id in task_ids]
        for req, token in found:
            if self._already_finished(req.id):
                self.fence({req.id})
                continue
            alloc = next((a for a in self.allocator.allocations() if a.key is req), None)
            if alloc is None:
                continue
            record = self._job_record(req, alloc, self.store._clock())
            try:
                self.leases.take(record, token)
                log.warning(
                    "ojs-ml: the lease of %s had vanished from the store; rewritten", req.id
                )
            except Exception as exc:
                log.warning("ojs-ml: could not rewrite the lease of %s: %s", req.id, exc)

    def recover_own(self) -> None:
        """On start, take back the jobs a previous incarnation of this worker was running."""
        try:
            for task_id in self.leases.stale_of(self.hostname, self.incarnation):
                lease = self.leases.claim(
                    task_id, self.hostname, self.incarnation, stale_owner=self.hostname
                )
                if lease is not None:
                    self.recover(lease, "this worker restarted")
        except Exception as exc:
            log.warning("ojs-ml: could not recover this worker's leases: %s", exc)

    def recover(self, lease: dict[str, Any], why: str) -> None:
        """Re-publish a claimed job with the same id and its last checkpoint (or dead-letter)."""
        task_id, token = lease["task_id"], lease["claim_token"]
        if self._already_finished(task_id):
            self.leases.release(task_id, token)
            return
        counted = gang_crash(self.store, lease["headers"])  # a gang's crash counts once
        crashes = int(lease["headers"].get("ojs_crashes") or 0) + 1 if counted is None else counted
        if crashes > self.settings.max_crashes:
            dead_letter(self.store, lease, f"{why}; crashed {crashes} times")
            self.leases.release(task_id, token)
            return
        headers = republish_headers(
            lease["headers"],
            ojs_crashes=crashes,
            ojs_last_checkpoint=last_checkpoint_of(self.store, task_id),
        )
        log.warning(
            "ojs-ml: re-publishing %s[%s]: %s (crash %d)", lease["name"], task_id, why, crashes
        )
        self.app.send_task(
            lease["name"],
            args=lease["args"],
            kwargs=lease["kwargs"],
            task_id=task_id,
            retries=lease["retries"],
            headers=headers,
        )
        self.leases.release(task_id, token)

    def _already_finished(self, task_id: str) -> bool:
        backend = self.app.backend
        if type(backend).__name__ == "DisabledBackend":
            return False
        try:
            return bool(self.app.AsyncResult(task_id).state in ("SUCCESS", "FAILURE", "REVOKED"))
        except Exception:
            return False

    def _failing(self, req: Any, original: Any) -> Any:
        """Failure path: re-publish a preempted job; dead-letter a checkpointed one (§14.2)."""

        def wrapped(exc_info: Any, *args: Any, **kwargs: Any) -> Any:
            if req in self.fenced:  # killed by `fence`: the copy that took over counts
                self.fenced.discard(req)
                worker_state.task_ready(req)
                log.warning("ojs-ml: stopped this copy of %s; it runs elsewhere", req.id)
                return None
            exc = getattr(exc_info, "exception", None)
            exc = getattr(exc, "exc", exc)
            if isinstance(exc, BaseException) and self.preemptions.yielded(req, exc):
                return self.preemptions.requeue(req, exc)
            terminal = not isinstance(exc, Retry | Ignore | Reject | Terminated)
            if terminal and isinstance(exc, BaseException) and requeue_rank(self, req, exc):
                return None  # a gang rank: its whole gang is placed again (integration.gangs)
            if terminal and HEADER_RENDEZVOUS in req.request_dict:
                give_up_rank(self, req, exc)
            result = original(exc_info, *args, **kwargs)
            if terminal and req.request_dict.get("ext_ml_checkpoint_enabled"):
                record = {
                    "task_id": req.id,
                    "name": req.name,
                    "args": list(req.args),
                    "kwargs": dict(req.kwargs),
                    "headers": republish_headers(req.request_dict),
                    "retries": int(req.request_dict.get("retries") or 0),
                }
                try:
                    dead_letter(self.store, record, f"failed: {exc!r}")
                except Exception as err:
                    log.warning("ojs-ml: could not dead-letter %s: %s", req.id, err)
            return result

        return wrapped


def refused_result(req: Any, reason: str) -> None:
    """Record a refused job as failed (result backend, `task-failed` event) with the reason."""
    exc = BadMessage(reason)
    req.task.backend.mark_as_failure(req.id, exc, request=None)
    req.send_event("task-failed", exception=repr(exc), traceback="")


def band_priority(headers: dict[str, Any]) -> int:
    """The message priority inside its band (higher first)."""
    value = headers.get("priority")
    return int(value) if isinstance(value, int) else 0
