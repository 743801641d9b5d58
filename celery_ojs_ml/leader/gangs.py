"""A gang's rendezvous, made when a pass places its ranks (Flux RFC 25 `node>slot`).

Key decisions:
* `MASTER_ADDR` is the address rank 0's worker advertises (read from the live
  registry when the gang is placed); `MASTER_PORT` is drawn afresh for every
  placement, below Linux's ephemeral ports (32768 and up), so a gang placed
  again never meets its old rendezvous, nor a port once the local end of some
  outgoing connection on rank 0's host (torch's store failed with EADDRINUSE).
* Which worker runs which rank of each placement is recorded, so the rank that
  fails first can stop the others (`worker.gangs.stop_peers` reads it).
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Mapping
from typing import Any

from celery_ojs_ml.scheduler import Decision, PendingJob
from celery_ojs_ml.store.registry import OJSStore

_PORTS = (29500, 32768)
"""`MASTER_PORT` is drawn from [29500, 32768): torch's default port and up."""
_GANG_TTL_S = 7 * 86400
"""How long a gang's record (`<prefix>:gang:<id>`) outlives its last write."""


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


def record_members(store: OJSStore, found: Mapping[str, Mapping[str, Any]]) -> None:
    """Keep which worker runs which rank of each placement `rendezvous` made, so that the
    rank that fails first can stop the others."""
    members: dict[tuple[str, str], dict[str, str]] = {}
    for task_id, rdv in found.items():
        gid, placement = str(rdv["gang"]), str(rdv["placement"])
        members.setdefault((gid, placement), {})[task_id] = str(rdv["worker"])
    for (gid, placement), ranks in members.items():
        key = store.key("gang", gid)
        store.client.hset(key, f"members:{placement}", json.dumps(ranks))
        store.client.expire(key, _GANG_TTL_S)
