"""A gang rank on its worker: a failed placement is counted once, its peers are stopped,
and the rank is re-published so the gang is placed again whole.

Key decisions:
- The rank that fails first counts the placement's crash (`gang_crash`) and asks
  every other rank's worker to stop its rank (`stop_peers`, control command
  `ojs_ml_stop_rank`): a rank blocked in its rendezvous or a collective would
  otherwise hold its worker until torch's own timeout.
- A stopped or failed rank is re-published with the same id and its last
  checkpoint until the gang has crashed `ojs_ml_max_crashes` times; then it
  fails with `STOPPED` (or its own error). The leader places gangs (`leader.gangs`).
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Mapping
from typing import Any

from celery.worker import state as worker_state

from celery_ojs_ml.errors import OJSMLError
from celery_ojs_ml.store.deadletter import republish_request
from celery_ojs_ml.wire.headers import RENDEZVOUS
from celery_ojs_ml.worker.running import Running

log = logging.getLogger(__name__)


def primary_address() -> str:
    """The address other hosts reach this one by (the interface of the default route).

    The worker advertises it (unless `ojs_ml_advertise_address` is set), and the leader
    makes it `MASTER_ADDR` for the gangs whose rank 0 runs here (`leader.gangs`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


_GANG_TTL_S = 7 * 86400
STOPPED = (
    "a peer of this gang rank's placement failed, and the gang has crashed more than "
    "ojs_ml_max_crashes times, so it is not placed again; the peer's result says why"
)
"""The failure a stopped rank of a gang that is not placed again is stored with."""


class GangFailed(OJSMLError):
    """A gang rank ends because its gang failed (`STOPPED`)."""


def gang_crash(store: Any, headers: Mapping[str, Any]) -> tuple[int, bool] | None:
    """Count a failed placement of the gang this rank belongs to once: the gang's crashes,
    and whether this rank is the first to report that placement's failure.

    None when `headers` are not a placed gang rank's. The first rank to report a
    placement's failure counts it; the other ranks of that placement (their peer
    died, or their worker did) get the same count, so a crash counts once for
    the gang.
    """
    found = headers.get(RENDEZVOUS)
    if not isinstance(found, Mapping) or not found.get("gang") or not found.get("placement"):
        return None
    key = store.key("gang", str(found["gang"]))
    client = store.client
    first = bool(client.hsetnx(key, f"failed:{found['placement']}", 1))
    if first:
        client.hincrby(key, "crashes", 1)
        client.expire(key, _GANG_TTL_S)
    return int(client.hget(key, "crashes") or 0), first


def stop_peers(app: Any, store: Any, headers: Mapping[str, Any], task_id: str) -> None:
    """The first rank of a placement to fail: ask every other rank's worker to stop its
    rank (control command `ojs_ml_stop_rank`). A rank blocked in its rendezvous or in a
    collective would otherwise hold its worker until torch's own timeout (30 minutes by
    default for gloo) before it fails and the gang can be placed again."""
    found = headers.get(RENDEZVOUS)
    if not isinstance(found, Mapping):
        return
    placement = str(found.get("placement"))
    try:  # never raises: the failed rank is re-published (or recovered) all the same
        raw = store.client.hget(store.key("gang", str(found.get("gang"))), f"members:{placement}")
        ranks: dict[str, str] = json.loads(raw) if raw else {}
        for peer, worker in ranks.items():
            if peer == task_id:
                continue
            app.control.broadcast(
                "ojs_ml_stop_rank",
                arguments={"task_id": peer, "placement": placement},
                destination=[worker],
                reply=False,
            )
            log.warning("ojs-ml: asked %s to stop gang rank %s (a peer failed)", worker, peer)
    except Exception as err:
        log.warning("ojs-ml: could not stop the peers of gang rank %s: %s", task_id, err)


def stop_rank(
    running: Running, stop_child: Callable[[Any], None], task_id: str, placement: str
) -> bool:
    """`ojs_ml_stop_rank` on this worker: kill the rank `task_id` if it still runs here for
    `placement` (a later placement of the same id is left alone). Its failure re-publishes
    it, and the gang is placed again whole once every rank is back."""
    req = running.requests.get(task_id)
    found = None if req is None else req.request_dict.get(RENDEZVOUS)
    if not isinstance(found, Mapping) or str(found.get("placement")) != placement:
        return False
    log.warning("ojs-ml: stopping gang rank %s: a peer of its placement failed", task_id)
    running.stopping.add(req)  # its failure re-places it, whatever the kill reports
    stop_child(req)
    return True


def requeue_rank(app: Any, store: Any, max_crashes: int, req: Any, exc: BaseException) -> bool:
    """A gang rank failed: re-publish it (same id, last checkpoint) so the gang is placed
    again whole; False (fail it as usual) once the gang crashed `ojs_ml_max_crashes` times."""
    try:
        counted = gang_crash(store, req.request_dict)
        if counted is None:
            return False
        crashes, first = counted
        if first:  # its peers may be blocked in the rendezvous or a collective: stop them
            stop_peers(app, store, req.request_dict, req.id)
        if crashes > max_crashes:
            return False  # the gang fails: so do its stopped peers (they give up too)
        republish_request(app, store, req, ojs_crashes=crashes)
    except Exception as err:  # the store or broker is down: fail it as usual, with the reason
        log.warning("ojs-ml: could not re-place gang rank %s: %s", req.id, err)
        return False
    worker_state.task_ready(req)
    log.warning(
        "ojs-ml: gang rank %s failed (%r); re-placing its gang (crash %d)", req.id, exc, crashes
    )
    # Flower sees a retry, as for a preempted job: the rank is received again when re-placed
    req.send_event(
        "task-retried", exception=f"GangReplaced({type(exc).__name__}, crashes={crashes})"
    )
    return True


def give_up_rank(app: Any, req: Any, exc: Any, *, event: bool = False) -> None:
    """Store the FAILURE of a rank not placed again (its child stored no result); with
    `event`, send its `task-failed` too (a stopped rank: Celery's own failure handling,
    which sends it, is bypassed, or the kill would show as REVOKED)."""
    try:
        app.backend.store_result(req.id, exc, "FAILURE")
    except Exception as err:
        log.warning("ojs-ml: could not store the failure of gang rank %s: %s", req.id, err)
    if event:
        req.send_event("task-failed", exception=repr(exc), traceback="")
