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
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import click
from celery import Celery, bootsteps, signals
from celery.worker.control import inspect_command

from celery_ojs_ml.allocator import Allocation, Allocator, Denied, Pending
from celery_ojs_ml.capabilities import Capabilities, capabilities_to_dict, resolve_capabilities
from celery_ojs_ml.integration.routing import HEADER_CLASS, ml_queue, queue_name
from celery_ojs_ml.matching import Verdict, match
from celery_ojs_ml.spec.classes import BANDS
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import MLRequirements

log = logging.getLogger(__name__)
GATES: dict[str, MLWorker] = {}
_REQ_CACHE: dict[str, MLRequirements] = {}


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
    signals.task_prerun.connect(_pin_devices, weak=False)
    signals.task_postrun.connect(_unpin_devices, weak=False)


def _requirements(headers: dict[str, Any]) -> MLRequirements | None:
    cid = headers.get(HEADER_CLASS)
    if not cid:
        return None
    attrs = {k: v for k, v in headers.items() if k.startswith("ext_ml_")}
    key = repr(sorted(attrs.items()))
    req = _REQ_CACHE.get(key)
    if req is None:
        req = normalize(attrs).requirements
        _REQ_CACHE[key] = req
    return req


class MLWorker(bootsteps.StartStopStep):  # type: ignore[misc]
    """Capabilities, advertisement, subscription and the gate of one consumer."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    label = "ojs-ml"

    def __init__(self, c: Any, ojs_ml_capabilities: str | None = None, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.c = c
        self.app = c.app
        self.caps: Capabilities = resolve_capabilities(ojs_ml_capabilities)
        self.prefork = _is_prefork(c)
        self.allocator = Allocator(self.caps)
        self.hostname = str(c.hostname)
        self.subscribed: set[str] = set()
        self.classes: dict[str, tuple[MLRequirements, list[str]]] = {}
        self.version = -1
        self._timers: list[Any] = []
        self._orig_handler = c.on_task_request
        c.on_task_request = self.on_task_request
        GATES[self.hostname] = self

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, c: Any) -> None:
        plugin = self.app.ojs_ml
        s = plugin.settings
        self.store = plugin.store
        self.version = -1
        self.subscribed = {q.name for q in c.task_consumer.queues if ".ml." in q.name}
        self.refresh()
        self.advertise()
        self._timers = [
            c.timer.call_repeatedly(s.subscription_poll_s, self.refresh),
            c.timer.call_repeatedly(s.heartbeat_s, self.advertise),
            c.timer.call_repeatedly(1.0, self.expire_holds),
        ]
        log.info("ojs-ml: %s", self.banner())

    def stop(self, c: Any) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers = []
        for pending in self.allocator.held():
            self.allocator.cancel(pending.key)
            self._release_hold(pending.key)

    def shutdown(self, c: Any) -> None:
        try:
            self.store.forget_worker(self.hostname)
        except Exception:  # the broker/store may already be gone at shutdown
            log.debug("ojs-ml: could not deregister %s", self.hostname)
        GATES.pop(self.hostname, None)

    def info(self, c: Any) -> dict[str, Any]:
        """Merged into `celery inspect stats`, and so into Flower's worker page."""
        return {"ojs_ml": self.snapshot()}

    def banner(self) -> str:
        """One line describing the worker for logs and the start banner."""
        labels = self.caps.derived_labels()
        gpus = (
            f"{self.caps.gpu_count}x {labels.get('gpu_type', 'gpu')}"
            if self.caps.gpu_count
            else "no GPU"
        )
        return f"{self.hostname}: {labels.get('accelerator')} worker, {gpus}, pool pinning " + (
            "CUDA_VISIBLE_DEVICES" if self.prefork else "off (one GPU job at a time)"
        )

    def snapshot(self) -> dict[str, Any]:
        """Capabilities, free capacity, allocations and held jobs."""
        return {
            "capabilities": capabilities_to_dict(self.caps),
            "allocator": self.allocator.snapshot(),
            "queues": sorted(self.subscribed),
        }

    # -- advertisement and subscription -------------------------------------------------------

    def advertise(self) -> None:
        """Heartbeat: capabilities and free capacity into the live-worker registry."""
        s = self.app.ojs_ml.settings
        snap = self.allocator.snapshot()
        self.store.advertise(
            self.hostname,
            capabilities_to_dict(self.caps),
            snap,
            ttl_s=3 * s.heartbeat_s,
            info={"pid": os.getpid()},
        )
        self.store.set_held(
            self.hostname, [p.as_dict() for p in self.allocator.held()], ttl_s=3 * s.heartbeat_s
        )

    def refresh(self) -> None:
        """Pick up new classes and (re)apply the queues that fit free capacity now."""
        version = self.store.classes_version()
        if version != self.version:
            self.classes = {
                cid: (normalize(entry["constraints"]).requirements, list(entry.get("queues", [])))
                for cid, entry in self.store.classes().items()
            }
            self.version = version
        self.resubscribe()

    def wanted_queues(self) -> set[str]:
        """Every (class, band) queue this worker can ever run and that fits free capacity."""
        free = self.allocator.free_capacity()
        wanted: set[str] = set()
        for cid, (req, queues) in self.classes.items():
            if match(req, self.caps, free).verdict is not Verdict.FITS:
                continue
            for logical in queues:
                wanted.update(queue_name(logical, cid, b) for b in BANDS)
        return wanted

    def resubscribe(self) -> None:
        tc = self.c.task_consumer
        if tc is None:
            return
        wanted = self.wanted_queues()
        for name in sorted(self.subscribed - wanted):
            tc.cancel_by_queue(name)
        added = sorted(wanted - self.subscribed)
        for name in added:
            tc.add_queue(ml_queue(name))
        if added:
            tc.consume()
        self.subscribed = wanted

    # -- the gate -------------------------------------------------------------------------------

    def on_task_request(self, req: Any) -> Any:
        headers = req.request_dict
        ml = _requirements(headers)
        if ml is None:
            return self._orig_handler(req)
        outcome = self.allocator.try_alloc(req, req.id, ml, priority=band_priority(headers))
        return self._handle(req, outcome)

    def _handle(self, req: Any, outcome: Allocation | Pending | Denied) -> Any:
        if isinstance(outcome, Allocation):
            return self._dispatch(req, outcome)
        if isinstance(outcome, Pending):
            self.allocator.hold(outcome)
            self.c.qos.increment_eventually()
            self.resubscribe()
            return None
        log.warning(
            "ojs-ml: %s cannot run %s here (%s); requeueing", self.hostname, req.id, outcome.reason
        )
        req.reject(requeue=True)
        return None

    def _dispatch(self, req: Any, alloc: Allocation) -> Any:
        req.request_dict["ojs_devices"] = list(alloc.devices)
        req.request_dict["ojs_node"] = self.hostname
        req.request_dict["ojs_pin"] = self.prefork
        for name in ("on_success", "on_failure"):
            setattr(req, name, self._releasing(req, getattr(req, name)))
        req.on_timeout = self._timeout_releasing(req, req.on_timeout)
        self.resubscribe()
        return self._orig_handler(req)

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
        if self.allocator.free(req) is None:
            return
        hub = getattr(self.c, "hub", None)
        if hub is not None:
            hub.call_soon(self.pump)
        else:
            self.pump()

    def pump(self) -> None:
        for alloc in self.allocator.pump():
            req: Any = alloc.key
            self._release_hold(req)
            if req.revoked():
                self.allocator.free(req)
                continue
            self._dispatch(req, alloc)
        self.resubscribe()

    def _release_hold(self, req: Any) -> None:
        self.c.qos.decrement_eventually()

    def expire_holds(self) -> None:
        """Requeue messages held longer than `ojs_ml_max_hold_s` (well below broker timeouts)."""
        for pending in self.allocator.expired(self.app.ojs_ml.settings.max_hold_s):
            req: Any = pending.key
            self._release_hold(req)
            req.reject(requeue=True)


def band_priority(headers: dict[str, Any]) -> int:
    """The message priority inside its band (higher first)."""
    value = headers.get("priority")
    return int(value) if isinstance(value, int) else 0


def _is_prefork(c: Any) -> bool:
    pool = getattr(getattr(c, "pool", None), "__module__", "") or ""
    return "prefork" in pool


# -- child side --------------------------------------------------------------------------------

_CHILD: dict[str, Any] = {"first_devices": None}


def _pin_devices(task: Any = None, **_: Any) -> None:
    """Set CUDA_VISIBLE_DEVICES to exactly the allocated devices before the body runs."""
    request = getattr(task, "request", None)
    devices = getattr(request, "ojs_devices", None)
    if request is None or devices is None or not getattr(request, "ojs_pin", False):
        return
    request.ojs_saved_cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)


def _unpin_devices(task: Any = None, **_: Any) -> None:
    request = getattr(task, "request", None)
    if request is None or not hasattr(request, "ojs_saved_cvd"):
        return
    saved = request.ojs_saved_cvd
    if saved is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = saved


@inspect_command()  # type: ignore[untyped-decorator]
def ojs_ml_status(state: Any, **_: Any) -> dict[str, Any]:
    """OJS ML: this worker's capabilities, allocations and held jobs."""
    gate = GATES.get(state.hostname)
    return gate.snapshot() if gate else {"ojs_ml": None, "host": socket.gethostname()}
