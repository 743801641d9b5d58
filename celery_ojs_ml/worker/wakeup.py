"""Make a Redis-transport consumer see newly added queues at once.

Key decision: kombu's Redis transport consumes with one `BRPOP q1 q2 ...` that
blocks for `brpop_timeout` (1 s); queues added meanwhile are only included in
the next BRPOP, so a worker whose GPU just became free would wait up to a
second before it could fetch the next job. Lowering `brpop_timeout` for the
whole app would make every idle worker poll Redis ten times a second. Instead,
when the subscription grows, the worker unblocks its own in-flight BRPOP with
`CLIENT UNBLOCK` (found by the socket's local address), so kombu immediately
re-issues it with the new queue list. Other transports (AMQP) push messages
and need nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_ojs_ml.celery_internals import blocked_brpop

log = logging.getLogger(__name__)


def wake_consumer(task_consumer: Any) -> bool:
    """Unblock the consumer's in-flight Redis BRPOP; False when there is none to unblock.

    The blocked connection's client id is looked up with `CLIENT LIST` once per socket
    and remembered, so a wake-up is then one `CLIENT UNBLOCK`."""
    found = blocked_brpop(task_consumer)
    if found is None:
        return False
    channel, client, sock = found
    try:
        host, port = sock.getsockname()[:2]
        addr = f"{host}:{port}"
        known: dict[str, str] = _IDS.setdefault(id(channel), {})
        helper = _connection(client.connection_pool)
        try:
            if addr in known:
                helper.send_command("CLIENT", "UNBLOCK", known[addr])
                if helper.read_response():
                    return True
            client_id = _find_brpop(helper, addr)
            if client_id is None:
                return False
            known.clear()  # one consuming socket per channel: forget older ones
            known[addr] = client_id
            helper.send_command("CLIENT", "UNBLOCK", client_id)
            return bool(helper.read_response())
        finally:
            client.connection_pool.release(helper)
    except Exception as exc:  # best effort: without it the next BRPOP picks the queues up
        log.debug("ojs-ml: could not unblock the consumer's BRPOP: %s", exc)
    return False


def _connection(pool: Any) -> Any:
    """A pooled connection (redis-py >= 5.3 takes no command name; older ones need one)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("CLIENT")


_IDS: dict[int, dict[str, str]] = {}
"""Per kombu channel: local address of its BRPOP socket -> Redis client id."""


def _find_brpop(helper: Any, addr: str) -> str | None:
    """The client id of the connection at `addr` blocked in BRPOP (`CLIENT LIST`)."""
    helper.send_command("CLIENT", "LIST", "TYPE", "normal")
    listing = helper.read_response()
    text = listing.decode() if isinstance(listing, bytes) else str(listing)
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split(" ") if "=" in f)
        if fields.get("addr") == addr and fields.get("cmd") == "brpop":
            return fields["id"]
    return None
