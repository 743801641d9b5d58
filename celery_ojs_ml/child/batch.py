"""The pool child's side of dynamic batching (`ml_batch`): call the task body once with
every request of its batch, then store each request's outcome under its own id.

    @app.task(bind=True, ml={"ext_ml_gpu_count": 1}, ml_batch={"max_size": 32, "max_wait_ms": 5})
    def embed(self, requests: list[BatchRequest]) -> list[Any]:
        net = model(self, ("encoder", "1"), load_encoder)
        return net([r.args[0] for r in requests])  # one result per request, in order

    embed.delay("a photo of a cat").get()  # this request's own result

Contract (docs/serving.md, "Dynamic batching"):
* The body receives a list of `BatchRequest` (id, args, kwargs, headers); the
  first is the request Celery runs (`self.request`), the others came with it.
* It returns a list (or tuple) with one item per request, in order. An item
  that is an exception instance fails that request alone (FAILURE, with that
  exception); any other item is that request's result.
* An exception raised by the body fails every request of the call with it,
  except `Preempted`: the worker then re-publishes every request as a
  preempted job. A return value of the wrong shape fails every request with
  `BatchResultError`.

Key decision: Celery's own trace runs the first request (result, state,
signals, time limits, pinning and the warm child's binding are exactly those
of any task); the others' outcomes are stored here with the result backend's
own calls (`mark_as_done` / `mark_as_failure`, which also complete chords and
call errbacks), their `link` callbacks and chain are applied, and their
`task-succeeded` / `task-failed` events are sent while the worker sends task
events. A call outside a worker (a direct call, `apply`, eager mode) gets a
list of one.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any

from celery import Celery, signature, states
from celery.app.task import Context
from celery.utils.saferepr import saferepr

from celery_ojs_ml.checkpoint.preempt import Preempted
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.batch import members_of, options_of

log = logging.getLogger(__name__)


class BatchResultError(TypeError):
    """A batched task returned something other than one result per request."""


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One request of a batched call."""

    id: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    headers: Mapping[str, Any] = field(default_factory=dict, repr=False)
    """The request's message headers and Celery's request fields (`ext_ml_*`, `retries`, ...)."""


def install(app: Celery) -> None:
    """Wrap every task that declares `ml_batch`, now and when the app finalizes."""
    app.on_after_finalize.connect(_wrap_all, weak=False)
    if app.finalized:
        _wrap_all(app)


def _wrap_all(sender: Celery, **_: Any) -> None:
    for task in list(sender.tasks.values()):
        wrap(task)


def wrap(task: Any) -> None:
    """Make `task.run` take the batch (see module doc). Idempotent. Argument checks at
    publish are off: the body's signature is the batch's. A bad `ml_batch` raises
    ConfigError, and every call of the task raises it too (Celery only logs what a
    finalize receiver raises; the worker refuses to start with it: `worker.batching`)."""
    if getattr(task, "_ojs_batch", False):
        return
    try:
        if options_of(task) is None:
            return
    except ConfigError as exc:
        task.run, task._ojs_batch = _raising(exc), True
        raise
    body = task.run

    def run(*args: Any, **kwargs: Any) -> Any:
        return run_batch(task, body, args, kwargs)

    task.run, task.typing, task._ojs_batch = run, False, True


def _raising(exc: ConfigError) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return run


def run_batch(task: Any, body: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """Call `body` with the batch of the request being run; store the others' outcomes;
    return the first request's result (raise its exception)."""
    request = task.request
    members, events = members_of(getattr(request, h.BATCH, None))
    own = {k: v for k, v in vars(request).items() if k != h.BATCH}
    first = BatchRequest(str(request.id), tuple(args), dict(kwargs), own)
    batch = [first, *(_request_of(m) for m in members)]
    if members and task.track_started:
        _mark_started(task, members)
    began = time.monotonic()
    try:
        out = body(batch)
    except Preempted:  # the worker re-publishes every request of the batch
        raise
    except Exception as exc:
        _settle(task, members, [exc] * len(members), time.monotonic() - began, events)
        raise
    results = _checked(task, out, len(batch))
    _settle(task, members, results[1:], time.monotonic() - began, events)
    if isinstance(results[0], BaseException):
        raise results[0]
    return results[0]


def _request_of(member: Mapping[str, Any]) -> BatchRequest:
    args, kwargs = member.get("args") or (), member.get("kwargs") or {}
    return BatchRequest(str(member.get("id")), tuple(args), dict(kwargs), member)


def _checked(task: Any, out: Any, size: int) -> list[Any]:
    """The body's results, or `BatchResultError` for each request when their shape is wrong."""
    if isinstance(out, list | tuple) and len(out) == size:
        return list(out)
    got = f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, Sized) else "")
    error = BatchResultError(
        f"task {task.name} received {size} requests and returned {got}; a batched task "
        "returns a list with one result per request, in order (an exception instance "
        "fails that request alone), e.g. return [handle(r.args[0]) for r in requests]"
    )
    return [error] * size


def _ignored(task: Any, ctx: Any) -> bool:
    found = getattr(ctx, "ignore_result", None)
    return bool(task.ignore_result if found is None else found)


def _mark_started(task: Any, members: list[dict[str, Any]]) -> None:
    """`task_track_started`: each request's STARTED state, as Celery's trace stores it."""
    for member in members:
        ctx = Context(member)
        if not _ignored(task, ctx):
            meta = {"pid": os.getpid(), "hostname": member.get("hostname")}
            task.backend.store_result(ctx.id, meta, states.STARTED, request=ctx)


def _settle(
    task: Any, members: list[dict[str, Any]], results: list[Any], runtime: float, events: bool
) -> None:
    """Store each request's outcome under its own id; then its event."""
    sent: list[tuple[str, dict[str, Any]]] = []
    for member, result in zip(members, results, strict=True):
        ctx = Context(member)
        try:
            if isinstance(result, BaseException):
                sent.append(_failed(task, ctx, result))
            else:
                sent.append(_succeeded(task, ctx, result, runtime))
        except Exception:  # one request's backend error never loses the others
            log.exception("ojs-ml: could not store the outcome of %s", ctx.id)
    if events and sent:
        _send_events(task.app, str(members[0].get("hostname") or ""), sent)


def _failed(task: Any, ctx: Any, exc: BaseException) -> tuple[str, dict[str, Any]]:
    tb = "".join(traceback.format_exception(exc)) if exc.__traceback__ else ""
    store = not _ignored(task, ctx) or bool(task.store_errors_even_if_ignored)
    task.backend.mark_as_failure(ctx.id, exc, tb or None, request=ctx, store_result=store)
    return "task-failed", {"uuid": ctx.id, "exception": saferepr(exc), "traceback": tb}


def _succeeded(task: Any, ctx: Any, result: Any, runtime: float) -> tuple[str, dict[str, Any]]:
    task.backend.mark_as_done(ctx.id, result, request=ctx, store_result=not _ignored(task, ctx))
    _follow_up(task.app, ctx, result)
    fields = {"uuid": ctx.id, "result": saferepr(result, task.resultrepr_maxsize)}
    return "task-succeeded", {**fields, "runtime": runtime}


def _follow_up(app: Celery, ctx: Any, result: Any) -> None:
    """A request's `link` callbacks and the rest of its chain, as Celery's trace applies them."""
    root = getattr(ctx, "root_id", None) or ctx.id
    for callback in getattr(ctx, "callbacks", None) or ():
        signature(callback, app=app).apply_async((result,), parent_id=ctx.id, root_id=root)
    chain = list(getattr(ctx, "chain", None) or ())
    if chain:
        after = signature(chain.pop(), app=app)
        after.apply_async((result,), chain=chain, parent_id=ctx.id, root_id=root)


def _send_events(app: Celery, hostname: str, sent: list[tuple[str, dict[str, Any]]]) -> None:
    try:
        with app.events.default_dispatcher(hostname=hostname or None) as dispatcher:
            for kind, fields in sent:
                dispatcher.send(kind, **fields)
    except Exception as exc:  # events never fail a request
        log.debug("ojs-ml: could not send a batch's task events: %s", exc)
