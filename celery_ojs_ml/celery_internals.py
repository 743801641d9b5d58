"""Every private Celery, kombu and billiard attribute the plugin reads.

Key decision: the plugin uses Celery's public hooks; where a private attribute
cannot be avoided it is read here, in one small function with the version it
was checked against, and `missing_internals()` plus tests/worker/test_warm_internals.py
and test_consumer_internals.py fail when one changes. Checked against celery
5.7.0, billiard 4.3.2 and kombu 5.7.0.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from celery.worker import state as worker_state

# -- the prefork pool (celery.concurrency.asynpool.AsynPool, celery 5.7.0) ----------------

POOL_ATTRIBUTES = ("outbound_buffer", "_fileno_to_inq", "_busy_workers", "_active_writes")
"""What the warm router reads on an AsynPool (set in `AsynPool.__init__`)."""


def missing_internals(pool: Any = None, hub: Any = None) -> list[str]:
    """What the warm router needs from celery's AsynPool (and the hub) that is not there."""
    from celery.concurrency import asynpool

    need = ("_create_write_handlers", "register_with_event_loop")
    missing = [f"AsynPool.{n}" for n in need if not hasattr(asynpool.AsynPool, n)]
    if pool is not None:
        missing += [f"AsynPool().{n}" for n in POOL_ATTRIBUTES if not hasattr(pool, n)]
    if hub is not None and not callable(getattr(hub, "consolidate_callback", None)):
        missing.append("Hub.consolidate_callback")
    return missing


def async_pool(consumer: Any) -> Any:
    """The consumer's AsynPool (`TaskPool._pool`), or None for other pools."""
    return getattr(getattr(consumer, "pool", None), "_pool", None)


def pool_pids(consumer: Any) -> list[int]:
    """Pids of the consumer's prefork pool children ([] for other pools): billiard's
    `Pool._pool`, the list of its worker processes."""
    procs = getattr(async_pool(consumer), "_pool", None) or []
    return [int(p.pid) for p in procs if getattr(p, "pid", None)]


def outbound(pool: Any) -> Any:
    """The jobs waiting for a pool process (a deque; the write scheduler pops its front)."""
    return pool.outbound_buffer


def process_of(pool: Any, fd: int) -> Any:
    """The pool process whose input pipe is `fd` (it has `.index` and `.pid`), or None."""
    return pool._fileno_to_inq.get(fd)


def pipes(pool: Any) -> list[int]:
    """The input pipes of every pool process."""
    return list(pool._fileno_to_inq)


def idle(pool: Any, ready: list[int]) -> list[int]:
    """The pipes in `ready` whose process runs no job and is not being written to."""
    busy, active = pool._busy_workers, pool._active_writes
    return [fd for fd in ready if fd not in busy and fd not in active]


def writing(pool: Any, fd: int) -> bool:
    """Whether a job is being written to pipe `fd` now (`AsynPool._active_writes`)."""
    return fd in pool._active_writes


def write_behind(pool: Any, fd: int, write: Callable[[], Any]) -> None:
    """Run `write` (the original write scheduler on `[fd]`) for a process that runs a job:
    under the fair strategy `schedule_writes` skips a pipe in `_busy_workers`, so the
    pipe leaves the set for the call; the write marks it busy again (and it is put
    back when nothing was written and it was there). The process reads the job when its
    running one returns, as under Celery's `-O default` strategy; billiard puts a job
    written to a process that exits before accepting it back in the outbound buffer
    (`AsynPool.on_partial_read`)."""
    busy = pool._busy_workers
    was = fd in busy
    busy.discard(fd)
    try:
        write()
    finally:
        if was:
            busy.add(fd)


def to_pool_now(consumer: Any, req: Any) -> bool:
    """Hand a request to the pool (its outbound buffer) at once; False if it was revoked.

    `WorkController._process_task_sem` admits a request only while fewer than `-c`
    are in flight (a `LaxBoundedSemaphore`, `worker_pool_putlocks`): a job written
    behind a running one (`worker.pipelining`) goes in beside them, as
    `WorkController._process_task` would. Its end releases the semaphore once more,
    which the lax bound caps at `-c`."""
    from celery.exceptions import TaskRevokedError

    try:
        req.execute_using_pool(consumer.pool)
    except TaskRevokedError:
        return False
    return True


def wrap_write_scheduler(hub: Any, schedule: Callable[..., Any]) -> Callable[..., Any]:
    """Put `schedule` in place of the pool's write scheduler; returns the original.

    `AsynPool._create_write_handlers` sets `hub.consolidate_callback =
    schedule_writes`, which the hub reads once in `create_loop`: call this from a
    consumer step's `register_with_event_loop`, before the loop starts.
    """
    original: Callable[..., Any] = hub.consolidate_callback
    hub.consolidate_callback = schedule
    return original


def maintain_pool(consumer: Any) -> Callable[[], Any] | None:
    """billiard's `Pool.maintain_pool` through celery's TaskPool (replaces exited children)."""
    return getattr(getattr(consumer, "pool", None), "maintain_pool", None)


def pool_processes(consumer: Any) -> int | None:
    """The processes (threads) of this worker's pool now; None before the pool starts.
    `BasePool.num_processes` (prefork: billiard's `Pool._processes`, which
    `--autoscale` moves); tests/integration/test_processes.py fails if that changes."""
    try:
        found = consumer.pool.num_processes
    except Exception:  # no consumer or pool yet, or a pool that is not started
        return None
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def prefetch_multiplier(consumer: Any) -> int | None:
    """The consumer's prefetch multiplier (`Consumer._update_prefetch_count` multiplies
    the pool's processes by it)."""
    found = getattr(consumer, "prefetch_multiplier", None)
    return found if isinstance(found, int) else None


def request_embed(req: Any) -> dict[str, Any]:
    """The callbacks, errbacks, chain and chord a request's message embeds: the third item
    of `Request._payload` (celery 5.7.0 `celery.worker.request`); {} where it has none
    (tests/worker/test_batching.py fails if that changes)."""
    try:
        embed = req._payload[2]
    except Exception:  # no payload (not a Celery request), or another layout
        return {}
    return dict(embed) if isinstance(embed, Mapping) else {}


# -- worker state and events (celery.worker, celery 5.7.0) ----------------------------------


def active_request_ids() -> list[Any] | None:
    """Ids of the requests a pool process has accepted and not finished
    (`celery.worker.state.active_requests`); None where Celery has no such set."""
    try:
        return [getattr(r, "id", None) for r in list(worker_state.active_requests)]
    except Exception:
        return None


def task_events_on(consumer: Any) -> bool:
    """Whether this worker sends task events now: started with `-E` or
    `worker_send_task_events`, or switched on since by the `enable_events` control
    command (Flower sends it). The consumer keeps an `EventDispatcher` whose `groups`
    is empty (every group: `-E` passes None, which it keeps as `set()`) or holds "task"
    then; with task events off it is {"worker"}, and it drops the worker's own `ojs-*`
    events too
    (`test_waiting_events_follow_the_workers_task_events_and_flowers_enable_events` in
    tests/integration/test_worker.py fails if that changes)."""
    dispatcher = getattr(consumer, "event_dispatcher", None)
    if dispatcher is None or not getattr(dispatcher, "enabled", False):
        return False
    groups = getattr(dispatcher, "groups", None)
    return not groups or "task" in groups


def add_task_started_fields(
    consumer: Any, fields_for: Callable[[Any], Mapping[str, Any] | None]
) -> bool:
    """Add `fields_for(task_id)` to the `task-started` events this consumer sends.

    `Request.on_accepted` sends `task-started` through `Request.send_event`, which
    calls the consumer's `event_dispatcher.send` only while events are on: with
    them off the wrapper never runs. The consumer's `Events` step builds a new
    dispatcher on every consumer restart, so call this from `start()` each time
    (`test_flower.py` in tests/integration fails if that changes). False where
    the consumer has no dispatcher."""
    dispatcher = getattr(consumer, "event_dispatcher", None)
    if dispatcher is None:
        return False
    if getattr(dispatcher, "_ojs_started_fields", False):
        return True
    original = dispatcher.send

    def send(type: str, *args: Any, **fields: Any) -> Any:
        if type == "task-started":
            fields.update(fields_for(fields.get("uuid")) or {})
        return original(type, *args, **fields)

    dispatcher.send, dispatcher._ojs_started_fields = send, True
    return True


# -- kombu (5.7.0) ---------------------------------------------------------------------------


def put_back_queue(task_consumer: Any, name: str, bound: Any) -> bool:
    """Put a queue the consumer bound before back in its table (`Consumer._queues`), as
    `add_queue` would without copying and binding it again; False where it cannot."""
    queues = getattr(task_consumer, "_queues", None)
    if bound.channel is not task_consumer.channel or not isinstance(queues, dict):
        return False
    queues[name] = bound
    return True


def blocked_brpop(task_consumer: Any) -> tuple[Any, Any, Any] | None:
    """(channel, redis client, socket) of the Redis channel's in-flight BRPOP, or None:
    kombu's Redis `Channel._in_poll` is the connection it polls on, and its `_sock`
    the socket."""
    channel = getattr(task_consumer, "channel", None)
    blocked = getattr(channel, "_in_poll", None)
    client = getattr(channel, "client", None)
    sock = getattr(blocked, "_sock", None)
    if not blocked or client is None or sock is None:
        return None
    return channel, client, sock


# -- kombu's Redis transport, for publishers (kombu 5.7.0 `kombu.transport.redis`) ----------

First = Callable[[Any], None]
"""Queues commands on a redis-py pipeline (a granted job's durable record)."""
_FIRST = threading.local()
log = logging.getLogger(__name__)


class _Commands:
    """Stands in for kombu's `PublishBatch`: `Channel._put(..., _publish_batch=b)` calls
    `b.add(command, *args)` for the LPUSH (and the PEXPIREs of a queue with `x-expires`)
    instead of sending them (tests/producer/test_put_first.py fails if that changes)."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, tuple[Any, ...]]] = []

    def add(self, command: str, *args: Any) -> None:
        self.commands.append((command, args))


def put_first(message_id: str, client: Any, first: First, alone: Callable[[], None]) -> None:
    """Send `first`'s commands ahead of the next Redis publish of message `message_id`,
    in the same round trip, where `client` talks to the broker's server and database;
    elsewhere `alone()` runs before the publish. Needs `install_put_first()`."""
    _FIRST.pending = (message_id, client, first, alone)


def install_put_first() -> bool:
    """Wrap kombu's Redis `Channel._put` (once per process) so that a publish carries the
    commands `put_first` left for it; False where kombu's Redis transport cannot load."""
    try:
        from kombu.transport import redis as kombu_redis
    except ImportError:  # redis-py missing: no Redis broker to publish to
        return False
    channel: Any = kombu_redis.Channel
    if getattr(channel._put, "_ojs_put_first", False):
        return True
    original: Callable[..., None] = channel._put

    @functools.wraps(original)  # `inspect.getsource` still reads kombu's own
    def _put(self: Any, queue: str, message: Any, **kwargs: Any) -> None:
        pending = getattr(_FIRST, "pending", None)
        if pending is None:
            original(self, queue, message, **kwargs)
            return
        _FIRST.pending = None
        try:
            _put_after(original, self, queue, message, pending, kwargs)
        except BaseException:
            _FIRST.pending = pending  # kombu's retry publishes again: the commands go with it
            raise

    _put._ojs_put_first = True  # type: ignore[attr-defined]
    channel._put = _put
    return True


def _put_after(
    put: Callable[..., None], channel: Any, queue: str, message: Any, pending: Any, kwargs: Any
) -> None:
    message_id, client, first, alone = pending
    headers = message.get("headers") if isinstance(message, Mapping) else None
    if kwargs.get("_publish_batch") is not None or (headers or {}).get("id") != message_id:
        alone()  # not this publish's: written first, as without the wrapper
        put(channel, queue, message, **kwargs)
        return
    batch = _Commands()
    put(channel, queue, message, _publish_batch=batch, **kwargs)
    with channel.conn_or_acquire() as broker:
        together = _same_database(broker, client)
        if not together:
            alone()
        with broker.pipeline(transaction=False) as pipe:
            if together:
                _queue_first(first, pipe, message_id)
            ahead = len(pipe)
            for command, args in batch.commands:
                getattr(pipe, command)(*args)
            results = pipe.execute(raise_on_error=False)
    for failed in (r for r in results[:ahead] if isinstance(r, Exception)):
        log.warning("ojs-ml: a command sent ahead of message %s failed: %s", message_id, failed)
    for failed in (r for r in results[ahead:] if isinstance(r, Exception)):
        raise failed


def _queue_first(first: First, pipe: Any, message_id: str) -> None:
    """`first(pipe)`; a failure is logged and the message still goes out (as a record
    written on its own that fails)."""
    try:
        first(pipe)
    except Exception as exc:
        log.warning("ojs-ml: could not queue the commands for message %s: %s", message_id, exc)


def _same_database(a: Any, b: Any) -> bool:
    """Whether two redis-py clients reach the same server and database (by address)."""
    ka, kb = a.connection_pool.connection_kwargs, b.connection_pool.connection_kwargs
    where = tuple(ka.get(f) for f in ("host", "port", "path", "db"))
    return where[:3] != (None, None, None) and where == tuple(
        kb.get(f) for f in ("host", "port", "path", "db")
    )
