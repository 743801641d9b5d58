"""Reliable intake for Redis brokers: no job is lost when the scheduler is killed.

kombu's Redis transport takes a message off its list (`BRPOP`) before it records it as
unacked, so a process killed in between loses it. For the intake queue, whose loss
nothing else would notice, the leader reads the broker's lists itself (`RedisIntake`);
on that Redis, wake-ups and deliveries are pushed directly (`wake_list`, `envelope`).

Key decision: a message is moved atomically onto a processing list
(`<intake>.ojs-processing`) and leaves it only once its job is in the pending set. The
one module that relies on kombu's Redis list layout: checked against kombu 5.7.0, and
`tests/integration/test_redis_intake.py` fails when it changes. Other brokers keep the
kombu consumer: AMQP brokers hold unacked messages on the server, with no such window.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import redis

from celery_ojs_ml.wire import headers as h

log = logging.getLogger(__name__)

WAKE_HEADER = h.WAKE
"""The header of a worker's wake-up message on the intake (`intake.HEADER_WAKE`)."""
POLL_S = 0.2
"""Longest slice the leader blocks for on the priority-0 list."""
PROCESSING_SUFFIX = ".ojs-processing"

_POP = """
local n, out, last = tonumber(ARGV[1]), {}, #KEYS
for i = 1, last - 1 do
  while #out < n do
    local item = redis.call('RPOPLPUSH', KEYS[i], KEYS[last])
    if not item then break end
    out[#out + 1] = item
  end
end
return out
"""
"""Move up to ARGV[1] messages, highest priority list first, into the processing list."""


_SWEEP = """
local last, moved = #KEYS, 0
for i = 1, last - 1 do
  local items = redis.call('LRANGE', KEYS[i], 0, -1)
  for j = #items, 1, -1 do
    local ok, doc = pcall(cjson.decode, items[j])
    local h = ok and type(doc) == 'table' and doc['headers'] or nil
    if type(h) == 'table' and h[ARGV[1]] and not h[ARGV[2]] then
      redis.call('LREM', KEYS[i], 1, items[j])
      redis.call('LPUSH', KEYS[last], items[j])
      moved = moved + 1
    end
  end
end
return moved
"""
"""Move every message published under a grant (header ARGV[1], no assignment ARGV[2])
from a worker's lists onto the intake's priority-0 list, oldest first, so it is taken
first."""


def queue_keys(channel: Any, queue: str) -> list[str]:
    """The lists kombu's Redis transport keeps `queue` in, highest priority first."""
    prefix = str(getattr(channel, "global_keyprefix", "") or "")
    keys = [prefix + channel._q_for_pri(queue, pri) for pri in channel.priority_steps]
    return list(dict.fromkeys(keys))


def sweep_granted(
    client: redis.Redis, channel: Any, queue: str, intake: str, grant: str, assign: str
) -> int:
    """Take the jobs published under a grant and still queued on `queue` (a worker's own
    queue) back to the intake, atomically (the worker cannot take one meanwhile);
    returns how many moved."""
    keys = [*queue_keys(channel, queue), queue_keys(channel, intake)[0]]
    return int(client.eval(_SWEEP, len(keys), *keys, grant, assign))


_TAKE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 1 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('LPUSH', KEYS[3], ARGV[2])
  return 1
end
return 0
"""
"""Move one unacked message (tag ARGV[1]) onto the intake as ARGV[2], unless it is gone."""


def restore_granted(
    client: redis.Redis, channel: Any, queue: str, intake: str, grant: str, assign: str
) -> int:
    """Give the jobs published under a grant that a departed worker took from `queue`
    and never finished with back to the intake (kombu would restore them to `queue`,
    which nobody reads any more, only after its visibility timeout); returns how many.
    kombu keeps each as `[message, exchange, routing key]` under its delivery tag."""
    prefix = str(getattr(channel, "global_keyprefix", "") or "")
    keys = [
        prefix + channel.unacked_key,
        prefix + channel.unacked_index_key,
        queue_keys(channel, intake)[0],
    ]
    moved = 0
    entries: dict[Any, Any] = client.hgetall(keys[0])
    for tag, payload in entries.items():
        try:
            message, _exchange, routing_key = json.loads(payload)
            headers = message.get("headers") or {}
        except (ValueError, TypeError, AttributeError):
            continue
        if routing_key != queue or not headers.get(grant) or headers.get(assign):
            continue
        moved += int(client.eval(_TAKE, 3, *keys, tag, json.dumps(message)))
    return moved


def backlog(client: redis.Redis, channel: Any, queues: list[str]) -> dict[str, int]:
    """Messages waiting on each of `queues` (one round trip)."""
    with client.pipeline(transaction=False) as pipe:
        for queue in queues:
            for key in queue_keys(channel, queue):
                pipe.llen(key)
        counts = [int(n) for n in pipe.execute()]
    out: dict[str, int] = {}
    per = len(counts) // len(queues) if queues else 0
    for i, queue in enumerate(queues):
        out[queue] = sum(counts[i * per : (i + 1) * per])
    return out


def oldest(
    client: redis.Redis, channel: Any, queues: list[str], header: str
) -> dict[str, float | None]:
    """The smallest value of `header` (a publish time) among the messages next in line
    on each of `queues` (the tail of each of its priority lists; one round trip): how
    long its oldest job has waited. None where none shows the header."""
    keys = {queue: queue_keys(channel, queue) for queue in queues}
    with client.pipeline(transaction=False) as pipe:
        for queue in queues:
            for key in keys[queue]:
                pipe.lindex(key, -1)
        raw = iter(pipe.execute())
    out: dict[str, float | None] = {}
    for queue in queues:
        times = [_header_of(next(raw), header) for _ in keys[queue]]
        found = [t for t in times if t is not None]
        out[queue] = min(found) if found else None
    return out


def _header_of(payload: Any, header: str) -> float | None:
    value = header_of(payload, header)
    return float(value) if isinstance(value, int | float) else None


def header_of(payload: Any, header: str) -> Any:
    """A header of a kombu message, given as its JSON text or already decoded; None when
    absent or unreadable."""
    if payload is None:
        return None
    try:
        message = json.loads(payload) if isinstance(payload, str | bytes) else payload
        return (message.get("headers") or {}).get(header)
    except (ValueError, TypeError, AttributeError):
        return None


def supports(channel: Any) -> bool:
    """Whether `channel` is kombu's Redis transport with the list layout this module reads."""
    try:
        from kombu.transport import redis as kombu_redis
    except ImportError:  # pragma: no cover - kombu always ships it
        return False
    return isinstance(channel, kombu_redis.Channel) and all(
        hasattr(channel, name) for name in ("pool", "sep", "priority_steps", "_q_for_pri")
    )


def wake_list(app: Any, intake: str) -> str | None:
    """The intake's priority-0 list, where a worker may push its wake-ups with the store's
    own client: when the store is the broker's Redis (`ojs_ml_store_url` unset or the
    broker URL) and kombu adds no `global_keyprefix`; else None (publish through kombu).

    The worker pushes them in the same round trip as its advertisement, instead of a
    kombu publish (an exchange lookup and a publish: the largest part of what a finished
    job cost the worker's main process)."""
    broker = str(app.conf.broker_url or "")
    store = app.ojs_ml.settings.store_url
    options = app.conf.broker_transport_options or {}
    if not broker.startswith(("redis://", "rediss://", "unix://")) or options.get(
        "global_keyprefix"
    ):
        return None
    return intake if store in (None, broker) else None


def direct_channel(app: Any, intake: str, channel: Any) -> Any | None:
    """`channel` when the leader may push its deliveries itself (`envelope`): a kombu
    Redis channel, under the conditions of `wake_list`; else None (publish via kombu)."""
    return channel if wake_list(app, intake) is not None and supports(channel) else None


def envelope(
    channel: Any,
    queue: str,
    body: bytes,
    headers: dict[str, Any],
    properties: dict[str, Any],
    content_type: str,
    content_encoding: str,
) -> tuple[str, bytes]:
    """`(list key, raw)`: `body` published to the default exchange with routing key
    `queue`, as kombu's Redis transport LPUSHes it (`Producer.publish` ->
    `Channel.basic_publish` -> `Channel._put`); checked against kombu 5.7.0.

    The leader pushes it in the same Lua call that records the assignment
    (`PendingBook.assign(push=)`), under the conditions of `wake_list`: one round trip
    per assignment instead of two. It is built by the channel's own `prepare_message`
    and `_inplace_augment_message`, so it is what kombu would have pushed."""
    from kombu.utils.json import dumps

    props = dict(properties)
    priority = props.pop("priority", 0) or 0
    props["delivery_mode"] = props.get("delivery_mode") or 2  # kombu's maybe_delivery_mode
    props["delivery_info"] = dict(props.get("delivery_info") or {})
    message = channel.prepare_message(
        body, priority, content_type, content_encoding, headers, props
    )
    channel._inplace_augment_message(message, "", queue)
    key = channel._q_for_pri(queue, channel._get_message_priority(message, reverse=False))
    return str(key), str(dumps(message)).encode()  # type: ignore[no-untyped-call]


def send_wake(app: Any, worker: str) -> None:
    """Tell the scheduler that `worker` freed capacity: a wake-up published on the intake
    queue through kombu (where `wake_list` is None, or from outside a worker)."""
    from celery_ojs_ml.wire.queues import intake_name, ml_queue

    name = intake_name(app.ojs_ml.settings.store_prefix)
    with app.producer_or_acquire() as producer:
        producer.publish(
            {"worker": worker},
            exchange=name,
            routing_key=name,
            headers={WAKE_HEADER: worker},
            declare=[ml_queue(name)],
            serializer="json",
            retry=False,
        )


def wake_message(worker: str) -> bytes:
    """A wake-up as kombu's Redis transport stores a message on a list (`IntakeMessage`)."""
    doc = {
        "body": "",
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": {WAKE_HEADER: worker},
        "properties": {},
    }
    return json.dumps(doc).encode()


class IntakeMessage:
    """One raw intake message, with the attributes the scheduler reads off a kombu message."""

    def __init__(self, raw: bytes, owner: RedisIntake) -> None:
        self.raw = raw
        self._owner = owner
        payload = json.loads(raw)
        props = dict(payload.get("properties") or {})
        body = payload.get("body") or ""
        if props.get("body_encoding") == "base64":
            self.body: bytes = base64.b64decode(body)
        else:
            self.body = body.encode() if isinstance(body, str) else bytes(body)
        self.headers: dict[str, Any] = dict(payload.get("headers") or {})
        self.properties: dict[str, Any] = props
        self.content_type: str | None = payload.get("content-type")
        self.content_encoding: str | None = payload.get("content-encoding")

    def ack(self) -> None:
        """Settled: taken off the processing list at the next `RedisIntake.done`."""
        self._owner.settled.append(self.raw)


class RedisIntake:
    """The intake queue's lists and the processing list, read by the leader only.

    A message is moved, atomically (one Lua script per batch), from the intake lists
    into the processing list, and leaves it only once its job is in the pending set
    (`done`), so a leader killed at any instant leaves every message it took there. A
    new leader (or the same one after an error) first takes what the processing list
    holds (`recover`); admission is idempotent per published message (`ojs_msg`, see
    `PendingBook.admit_many`), so a message admitted just before the kill is not
    admitted twice. With nothing to read, the leader blocks on the priority-0 list
    (where wake-ups and jobs without a priority land) in slices of `POLL_S`; a job
    published with a Celery priority of 3 or more waits at most that long.
    """

    def __init__(self, channel: Any, queue: str, batch: int) -> None:
        pool = channel.pool
        kwargs: dict[str, Any] = {"connection_pool": pool}
        if pool.connection_kwargs.get("credential_provider") is not None:
            kwargs["credential_provider"] = pool.connection_kwargs["credential_provider"]
        self.client = redis.Redis(**kwargs)
        prefix = str(getattr(channel, "global_keyprefix", "") or "")
        self.keys = queue_keys(channel, queue)  # highest priority first, as kombu's BRPOP
        self.processing = prefix + queue + PROCESSING_SUFFIX
        self.batch = batch
        self.settled: list[bytes] = []
        self._pop: Any = self.client.register_script(_POP)

    def recover(self) -> list[IntakeMessage]:
        """What an earlier leader took and did not settle (admit, refuse or drop)."""
        raws: list[Any] = self.client.lrange(self.processing, 0, -1)
        if raws:
            log.warning("ojs-ml: the intake holds %d messages an earlier leader took", len(raws))
        return self._messages(reversed(raws))  # oldest first (LPUSH-ed at the head)

    def pop(self, wait_s: float) -> list[IntakeMessage]:
        """Up to `batch` messages there now; else the first to come within `wait_s` (one
        `POLL_S` slice at most)."""
        raws: list[bytes] = self._pop(keys=[*self.keys, self.processing], args=[self.batch])
        if raws or wait_s <= 0:
            return self._messages(raws)
        item = self.client.brpoplpush(self.keys[0], self.processing, min(wait_s, POLL_S))
        # Only the one that woke us: a job arriving at an idle leader is admitted without
        # another round trip; what came with it is read, without waiting, next step.
        return [] if item is None else self._messages([item])

    def done(self) -> None:
        """Take every settled message off the processing list (one round trip)."""
        settled, self.settled = self.settled, []
        if not settled:
            return
        with self.client.pipeline(transaction=False) as pipe:
            for raw in settled:
                pipe.lrem(self.processing, -1, raw)  # type: ignore[arg-type]
            pipe.execute()

    def done_in(self, pipe: Any) -> None:
        """`done`'s commands queued on `pipe`, a pipeline on the broker's Redis the caller
        runs (the leader's assignments: one round trip fewer per pass). Should it fail,
        the messages stay in the processing list: a leader reads them again when it
        connects (`recover`), and their admission finds them admitted (`ojs_msg`)."""
        settled, self.settled = self.settled, []
        for raw in settled:
            pipe.lrem(self.processing, -1, raw)

    def close(self) -> None:
        """Forget what was not settled: it stays in the processing list for `recover`."""
        self.settled = []
        self.client.close()

    def _messages(self, raws: Any) -> list[IntakeMessage]:
        out: list[IntakeMessage] = []
        for raw in raws:
            try:
                out.append(IntakeMessage(raw, self))
            except (ValueError, TypeError, AttributeError) as exc:
                log.error("ojs-ml: dropping an intake message that is not kombu JSON: %s", exc)
                self.settled.append(raw)
        return out


def depth(channel: Any, queue: str) -> tuple[int, int]:
    """(messages published to the intake and not yet taken, messages a leader took and has
    not settled yet): what `celery ojs-ml status` shows while jobs wait to be admitted."""
    reader = RedisIntake(channel, queue, batch=1)
    with reader.client.pipeline(transaction=False) as pipe:
        for key in (*reader.keys, reader.processing):
            pipe.llen(key)
        counts = [int(n) for n in pipe.execute()]
    return sum(counts[:-1]), counts[-1]
