"""The demo's Celery app: one task per job `type` in the specs' examples.

`celery -A celery_ojs_ml.demo.app worker --ojs-ml-capabilities=profile:NAME`
runs a real demo worker; the broker comes from `OJS_DEMO_BROKER` (default
`memory://`), and with Redis the result backend and the plugin's store are that
same Redis. The embedded runner builds its own app with `make_app("memory://")`.
Each task reports where it ran, as its STARTED state and its result (`_define`).

Key decision: tasks take `*args` because a chain step receives the previous
step's result before its own arguments, and the module builds its `app` lazily
(module `__getattr__`), so importing `make_app` never creates a second app.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from celery import Celery
from kombu.entity import Queue

from celery_ojs_ml import OJSML
from celery_ojs_ml.demo.jobs import REGISTRY_ACCESS
from celery_ojs_ml.wire import headers as h

BROKER_ENV = "OJS_DEMO_BROKER"
TASK_TYPES = ("ml.data_prep", "ml.train", "ml.evaluate", "ml.deploy", "ml.inference")
"""Every `type` the demo's example jobs use."""
WORK_S = {
    "ml.data_prep": 0.8,
    "ml.train": 1.5,
    "ml.evaluate": 1.0,
    "ml.deploy": 0.3,
    "ml.inference": 0.6,
}
"""How long each kind of job pretends to work, in seconds."""
QUEUES = (
    "celery",
    "cpu-inference",
    "cpu-workers",
    "deployment",
    "gpu-inference",
    "gpu-spot",
    "gpu-training",
    "tpu-training",
)
"""Every logical queue the example jobs name. They are the app's `task_queues`, so a demo
worker started without `-Q` consumes them all (the plugin takes ML jobs of a worker's own
queues only, as plain Celery does)."""


def make_app(broker: str, **conf: Any) -> Celery:
    """The demo app on `broker` (`memory://` in process, or `redis://...`)."""
    app = Celery("ojs-ml-demo", broker=broker, set_as_current=False)
    embedded = broker.startswith("memory://")
    app.conf.update(
        result_backend="cache+memory://" if embedded else broker,
        broker_transport_options=(
            {"polling_interval": 0.05} if embedded else {"visibility_timeout": 3600}
        ),
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        result_expires=3600,
        ojs_ml_subscription_poll_s=0.2,
        ojs_ml_heartbeat_s=0.5,
        ojs_ml_model_registry_access=REGISTRY_ACCESS,  # the demo's workers fetch any model
        task_queues=[Queue(name) for name in QUEUES],  # type: ignore[no-untyped-call]
    )
    app.conf.update(conf)
    OJSML(app)
    for name in TASK_TYPES:
        _define(app, name)
    return app


def _define(app: Celery, name: str) -> None:
    """Define the task `name`: it pretends to work for a moment and returns where it ran.

    Where: the worker node (`request.ojs_node`, set by the gate) and the GPU indices the
    gate allocated (`request.ojs_devices`). It also reports them as its STARTED state,
    so the live table shows running jobs with their devices.
    """

    @app.task(bind=True, name=name, shared=False)  # type: ignore[untyped-decorator]
    def work(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        started = time.time()
        where = {
            "node": node_of(self),
            "devices": [int(d) for d in getattr(self.request, h.DEVICES, None) or []],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "pid": os.getpid(),
            "started": started,
        }
        self.update_state(state="STARTED", meta=where)
        time.sleep(WORK_S.get(name, 0.5))
        return {**where, "finished": time.time()}


def node_of(task: Any) -> str:
    """The worker that runs `task`: the gate says so for ML jobs; plain tasks need a look-up.

    Under the threads pool Celery sets `request.hostname` to the machine's name
    (`trace_task_ret`, Celery 5.7), so for a plain task in the embedded demo the
    worker is found among `celery.worker.state.active_requests`, which holds the
    worker's own Request objects (process-global, hence the match by id).
    """
    node = getattr(task.request, h.NODE, None)
    if node:
        return str(node)
    from celery.worker import state

    for req in list(state.active_requests):
        if req.id == task.request.id:
            return str(req.hostname)
    return str(task.request.hostname or socket.gethostname())


def __getattr__(name: str) -> Any:
    """`app`: the demo app on `$OJS_DEMO_BROKER`, built on first use (`celery -A`)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    found = make_app(os.environ.get(BROKER_ENV) or "memory://")
    globals()["app"] = found
    return found
