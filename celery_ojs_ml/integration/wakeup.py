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

log = logging.getLogger(__name__)


def wake_consumer(task_consumer: Any) -> bool:
    """Unblock the consumer's in-flight Redis BRPOP; False when there is none to unblock."""
    channel = getattr(task_consumer, "channel", None)
    blocked = getattr(channel, "_in_poll", None)
    client = getattr(channel, "client", None)
    sock = getattr(blocked, "_sock", None)
    if not blocked or client is None or sock is None:
        return False
    try:
        host, port = sock.getsockname()[:2]
        addr = f"{host}:{port}"
        helper = client.connection_pool.get_connection("CLIENT")
        try:
            helper.send_command("CLIENT", "LIST", "TYPE", "normal")
            listing = helper.read_response()
            text = listing.decode() if isinstance(listing, bytes) else str(listing)
            for line in text.splitlines():
                fields = dict(f.split("=", 1) for f in line.split(" ") if "=" in f)
                if fields.get("addr") == addr and fields.get("cmd") == "brpop":
                    helper.send_command("CLIENT", "UNBLOCK", fields["id"])
                    helper.read_response()
                    return True
        finally:
            client.connection_pool.release(helper)
    except Exception as exc:  # best effort: without it the next BRPOP picks the queues up
        log.debug("ojs-ml: could not unblock the consumer's BRPOP: %s", exc)
    return False
