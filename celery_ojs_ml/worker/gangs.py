"""Gangs (Flux RFC 25 `node>slot`, `ext_ml_distributed_strategy`): publish, rendezvous, env.

Responsibility: `OJSML.gang` publishes one Celery task per rank, each marked
with the `ojs_gang` header; the scheduler places the ranks all at once
(`scheduler.gang`) and gives each delivery an `ojs_rendezvous` header; the
pool child turns it into the environment of torch.distributed's `env://`
(`MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK`, `LOCAL_RANK`) around the
task body.

Key decisions:
- `MASTER_ADDR` is the address rank 0's worker advertises
  (`ojs_ml_advertise_address`, default: the host's primary address), read from
  the live registry when the gang is placed.
- `MASTER_PORT` is drawn afresh for every placement from
  `_PORTS`, so a gang placed again after a failure never meets its old
  rendezvous still bound on the same host. The range ends below Linux's default
  ephemeral ports (`net.ipv4.ip_local_port_range`, 32768-60999; other systems
  start higher): a port drawn from it was once the local end of some outgoing
  connection on rank 0's host, and torch's store failed with EADDRINUSE.
- One rank per worker, so `LOCAL_RANK` is 0 and `LOCAL_WORLD_SIZE` 1.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import uuid
from collections.abc import Mapping
from typing import Any

from celery_ojs_ml.errors import OJSMLError, SpecError, Violation
from celery_ojs_ml.leader.fleet_view import _MAX_GANG, HEADER_GANG
from celery_ojs_ml.scheduler import Decision, PendingJob

log = logging.getLogger(__name__)
HEADER_RENDEZVOUS = "ojs_rendezvous"
_PORTS = (29500, 32768)
"""`MASTER_PORT` is drawn from [29500, 32768): torch's default port and up, below the
ephemeral ports the kernel gives outgoing connections (see the module doc)."""
ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def primary_address() -> str:
    """The address other hosts reach this one by (the interface of the default route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def rendezvous(
    decision: Decision, jobs: Mapping[str, PendingJob], live: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """The `ojs_rendezvous` header of every gang rank this pass assigns."""
    ranks: dict[str, list[tuple[PendingJob, str]]] = {}
    for a in decision.assignments:
        job = jobs.get(a.task_id)
        if job is not None and job.gang is not None:
            ranks.setdefault(job.gang, []).append((job, a.worker))
    out: dict[str, dict[str, Any]] = {}
    for gid, members in ranks.items():
        head = next((w for j, w in members if j.rank == 0), members[0][1])
        info = (live.get(head) or {}).get("info") or {}
        port = master_port()
        placement = uuid.uuid4().hex[:12]
        for job, worker in members:
            out[job.task_id] = {
                "gang": gid,
                "placement": placement,
                "master_addr": str(info.get("address") or "127.0.0.1"),
                "master_port": port,
                "world_size": job.gang_size,
                "rank": job.rank,
                "worker": worker,
            }
    return out


def master_port() -> int:
    """A fresh `MASTER_PORT` for one placement of a gang."""
    return random.randrange(*_PORTS)


def env_of(found: Any) -> dict[str, str]:
    """The launcher environment of an `ojs_rendezvous` header ({} when it is not one)."""
    if not isinstance(found, Mapping):
        return {}
    try:
        return {
            "MASTER_ADDR": str(found["master_addr"]),
            "MASTER_PORT": str(int(found["master_port"])),
            "WORLD_SIZE": str(int(found["world_size"])),
            "RANK": str(int(found["rank"])),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
        }
    except (KeyError, TypeError, ValueError):
        return {}


def set_env(request: Any) -> None:
    """`task_prerun`: export the rendezvous of a gang rank, remembering what was there."""
    env = env_of(getattr(request, HEADER_RENDEZVOUS, None))
    if env:
        request.ojs_saved_env = {k: os.environ.get(k) for k in ENV_KEYS}
        os.environ.update(env)


def restore_env(request: Any) -> None:
    """`task_postrun`: put the environment back as it was before the rank ran."""
    saved = getattr(request, "ojs_saved_env", None)
    if not isinstance(saved, dict):
        return
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


_GANG_TTL_S = 7 * 86400
STOPPED = (
    "a peer of this gang rank's placement failed, and the gang has crashed more than "
    "ojs_ml_max_crashes times, so it is not placed again; the peer's result says why"
)
"""The failure a stopped rank of a gang that is not placed again is stored with."""


class GangFailed(OJSMLError):
    """A gang rank ends because its gang failed (`STOPPED`)."""


def record_members(store: Any, found: Mapping[str, Mapping[str, Any]]) -> None:
    """Keep which worker runs which rank of each placement `rendezvous` made, so that the
    rank that fails first can stop the others (`stop_peers`)."""
    members: dict[tuple[str, str], dict[str, str]] = {}
    for task_id, rdv in found.items():
        gid, placement = str(rdv["gang"]), str(rdv["placement"])
        members.setdefault((gid, placement), {})[task_id] = str(rdv["worker"])
    for (gid, placement), ranks in members.items():
        key = store.key("gang", gid)
        store.client.hset(key, f"members:{placement}", json.dumps(ranks))
        store.client.expire(key, _GANG_TTL_S)


def gang_crash(store: Any, headers: Mapping[str, Any]) -> tuple[int, bool] | None:
    """Count a failed placement of the gang this rank belongs to once: the gang's crashes,
    and whether this rank is the first to report that placement's failure.

    None when `headers` are not a placed gang rank's. The first rank to report a
    placement's failure counts it; the other ranks of that placement (their peer
    died, or their worker did) get the same count, so a crash counts once for
    the gang.
    """
    found = headers.get(HEADER_RENDEZVOUS)
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
    found = headers.get(HEADER_RENDEZVOUS)
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


def stop_rank(gate: Any, task_id: str, placement: str) -> bool:
    """`ojs_ml_stop_rank` on this worker: kill the rank `task_id` if it still runs here for
    `placement` (a later placement of the same id is left alone). Its failure re-publishes
    it, and the gang is placed again whole once every rank is back."""
    req = gate._requests.get(task_id)
    found = None if req is None else req.request_dict.get(HEADER_RENDEZVOUS)
    if not isinstance(found, Mapping) or str(found.get("placement")) != placement:
        return False
    log.warning("ojs-ml: stopping gang rank %s: a peer of its placement failed", task_id)
    gate.stopping.add(req)  # its failure re-places it, whatever the kill reports
    gate.stop_child(req)
    return True


def requeue_rank(gate: Any, req: Any, exc: BaseException) -> bool:
    """A gang rank failed: re-publish it (same id, last checkpoint) so the gang is placed
    again whole; False (fail it as usual) once the gang crashed `ojs_ml_max_crashes` times."""
    from celery.worker import state as worker_state

    from celery_ojs_ml.store.deadletter import republish_request

    try:
        counted = gang_crash(gate.store, req.request_dict)
        if counted is None:
            return False
        crashes, first = counted
        if first:  # its peers may be blocked in the rendezvous or a collective: stop them
            stop_peers(gate.app, gate.store, req.request_dict, req.id)
        if crashes > gate.settings.max_crashes:
            return False  # the gang fails: so do its stopped peers (they give up too)
        republish_request(gate.app, gate.store, req, ojs_crashes=crashes)
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


def give_up_rank(gate: Any, req: Any, exc: Any, *, event: bool = False) -> None:
    """Store the FAILURE of a rank not placed again (its child stored no result); with
    `event`, send its `task-failed` too (a stopped rank: Celery's own failure handling,
    which sends it, is bypassed, or the kill would show as REVOKED)."""
    try:
        gate.app.backend.store_result(req.id, exc, "FAILURE")
    except Exception as err:
        log.warning("ojs-ml: could not store the failure of gang rank %s: %s", req.id, err)
    if event:
        req.send_event("task-failed", exception=repr(exc), traceback="")


def store_rank_result(sender: Any = None, result: Any = None, **_: Any) -> None:
    """A gang rank's success, stored in the pool child (from its `task_postrun` hook,
    `worker_setup._child_postrun`): a rank runs with `ignore_result`, so that a failure
    that re-places its gang stores nothing. Takes `task_success`'s arguments."""
    request: Any = getattr(sender, "request", None)
    if is_rank(request):
        sender.backend.store_result(request.id, result, "SUCCESS", request=request)


def is_rank(request: Any) -> bool:
    """Whether a task's request is a gang rank's (it carries the gang's rendezvous)."""
    return request is not None and isinstance(getattr(request, HEADER_RENDEZVOUS, None), Mapping)


def gang_headers(size: Any) -> list[dict[str, Any]]:
    """One `ojs_gang` header per rank of a new gang of `size`."""
    if not isinstance(size, int) or isinstance(size, bool) or not 2 <= size <= _MAX_GANG:
        raise SpecError(
            Violation("size", f"is {size!r}", "Flux RFC 25 node>slot",
                      f"a gang has 2 to {_MAX_GANG} ranks; run a single job for one")
        )  # fmt: skip
    gid = f"gang-{uuid.uuid4().hex[:12]}"
    return [{HEADER_GANG: {"id": gid, "size": size, "rank": r}} for r in range(size)]
