"""A preempted job whose re-publish fails keeps its lease (DESIGN decision 5, invariant 5).

The worker re-publishes a job that yielded to preemption. When the broker (or the store)
does not answer at that moment, the job's lease is the only thing left that holds it:
it must not be released with the run. `Preemptions.requeue` leaves it (`Running.forsake`:
no refresh, no release, no ack), so it expires and whoever claims it re-publishes the
job. Seen in the chaos campaign as a spot job lost across a broker restart.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from kombu.exceptions import OperationalError

from celery_ojs_ml.checkpoint import Preempted
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.settings import OJSMLSettings
from celery_ojs_ml.worker.preemption import Preemptions
from celery_ojs_ml.worker.running import Running


class _App:
    """What `requeue` uses of the app: its store and `send_task`."""

    def __init__(self, store: OJSStore, broker_up: bool) -> None:
        self.ojs_ml = SimpleNamespace(store=store)
        self.broker_up = broker_up
        self.sent: list[str] = []

    def send_task(self, name: str, **kwargs: Any) -> None:
        if not self.broker_up:
            raise OperationalError("Error 111 connecting to 127.0.0.1:6399. Connection refused.")
        self.sent.append(kwargs["task_id"])


class _Request:
    id = "0195f0a4-5678-7abc-8000-00000000pre1"
    name = "train"

    def __init__(self) -> None:
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.request_dict: dict[str, Any] = {"ext_ml_checkpoint_enabled": True}
        self.events: list[str] = []

    def send_event(self, kind: str, **_: Any) -> None:
        self.events.append(kind)


def _preemptions(app: _App, running: Running) -> Preemptions:
    consumer = SimpleNamespace(event_dispatcher=None)
    found = Preemptions(app, consumer, OJSMLSettings(), SimpleNamespace(), lambda pid: True, True)
    found.forsake = running.forsake
    return found


@pytest.mark.parametrize("broker_up", [True, False], ids=["published", "broker-down"])
def test_a_preempted_job_is_re_published_or_else_keeps_its_lease(
    store: OJSStore, broker_up: bool
) -> None:
    app, running, req = _App(store, broker_up), Running(), _Request()
    running.tokens[req] = "lease-token"
    _preemptions(app, running).requeue(req, Preempted(req.id, epoch=3, sequence=4))
    if broker_up:
        assert app.sent == [req.id] and req.events == ["task-retried"]
        assert running.tokens[req] == "lease-token", "released with the run, as usual"
    else:
        assert app.sent == [] and req.events == []
        assert req not in running.tokens, "its lease is left to expire, not released"
