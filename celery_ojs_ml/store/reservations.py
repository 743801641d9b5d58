"""Dynamic reservations (OJS ML §8.3): the store records, the publish check, the worker pools.

Responsibility: one record per reservation, written by `OJSML.reserve`/`release` and
the elected scheduler (placement, expiry), read by the router (the §8.3 check at
publish), the scheduler (`ReservationPool`s for the pure core) and each worker (the
pools its gate holds). The pure rules live in `scheduler.pools` and `allocator.pools`.

Key decision: a record moves waiting -> placed -> ended, each change a compare-and-set
(WATCH/MULTI), so a release racing the scheduler's placement is never undone; an ended
record is kept for `_ENDED_KEEP_S` so that a job naming it is denied with the reason.

Layout: `<prefix>:{ml}:reservations`  hash  reservation id -> JSON record
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from celery_ojs_ml.allocator.model import Demand
from celery_ojs_ml.errors import SpecError, Violation
from celery_ojs_ml.scheduler.pools import ReservationPool
from celery_ojs_ml.spec.envelope import requirements_of
from celery_ojs_ml.spec.resources import MLRequirements

log = logging.getLogger(__name__)

WAITING, PLACED, ENDED = "waiting", "placed", "ended"
_ENDED_KEEP_S = 86_400.0
"""How long an ended reservation's record is kept (jobs naming it are denied meanwhile)."""
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_ATTR = "ext_ml_reservation_id"
_SECTION = "OJS ML §8.3"

Parse = Callable[[Mapping[str, Any]], MLRequirements]


class ReservationBook:
    """The reservation records in the store (see module doc)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.key = store.key("reservations")

    def create(
        self, rid: str, requirements: Mapping[str, Any], timeout_s: float | None
    ) -> dict[str, Any]:
        now = time.time()
        record = {
            "id": rid,
            "requirements": dict(requirements),
            "created_at": now,
            "expires_at": None if timeout_s is None else now + timeout_s,
            "state": WAITING,
            "worker": None,
        }
        if not self.store.client.hsetnx(self.key, rid, json.dumps(record)):
            raise SpecError(
                Violation(
                    "reservation_id",
                    f"{rid!r} is already in use",
                    _SECTION,
                    "release it first, or pick another id (or pass none to get a fresh one)",
                )
            )
        return record

    def get(self, rid: str) -> dict[str, Any] | None:
        raw = self.store.client.hget(self.key, rid)
        return None if raw is None else _decode(raw)

    def all(self) -> dict[str, dict[str, Any]]:
        out = {}
        for rid, raw in self.store.client.hgetall(self.key).items():
            found = _decode(raw)
            if found is not None:
                out[rid.decode() if isinstance(rid, bytes) else str(rid)] = found
        return out

    def update(self, rid: str, change: Callable[[dict[str, Any]], bool]) -> bool:
        """Apply `change` to the record atomically; False when gone or `change` said no."""

        def txn(pipe: Any) -> bool:
            raw = pipe.hget(self.key, rid)
            record = None if raw is None else _decode(raw)
            if record is None or not change(record):
                pipe.multi()
                return False
            pipe.multi()
            pipe.hset(self.key, rid, json.dumps(record))
            return True

        return bool(self.store.client.transaction(txn, self.key, value_from_callable=True))

    def place(self, rid: str, worker: str) -> bool:
        def change(r: dict[str, Any]) -> bool:
            if r.get("state") == ENDED or r.get("worker") == worker:
                return False  # (a placed one is placed again when its worker left)
            r.update(state=PLACED, worker=worker, placed_at=time.time())
            return True

        return self.update(rid, change)

    def end(self, rid: str, why: str) -> bool:
        def change(r: dict[str, Any]) -> bool:
            if r.get("state") == ENDED:
                return False
            r.update(state=ENDED, ended_at=time.time(), why=why)
            return True

        return self.update(rid, change)

    def extend(self, rid: str, until: float) -> None:
        def change(r: dict[str, Any]) -> bool:
            at = r.get("expires_at")
            if r.get("state") == ENDED or at is None or at >= until:
                return False
            r["expires_at"] = until
            return True

        self.update(rid, change)

    def note(self, rid: str, reason: str) -> None:
        def change(r: dict[str, Any]) -> bool:
            if r.get("reason") == reason or r.get("state") != WAITING:
                return False
            r["reason"] = reason
            return True

        self.update(rid, change)

    def tend(self, now: float) -> dict[str, dict[str, Any]]:
        """End expired reservations, delete those ended long ago; return every record."""
        found = self.all()
        for rid, r in found.items():
            ended = r.get("state") == ENDED
            if ended and now - float(r.get("ended_at") or 0.0) > _ENDED_KEEP_S:
                self.store.client.hdel(self.key, rid)
            expires = r.get("expires_at")
            if (
                not ended
                and expires is not None
                and now >= float(expires)
                and self.end(rid, "expired")
            ):
                log.info("ojs-ml: reservation %s expired", rid)
                r.update(state=ENDED, why="expired")
        return found


def new_id(rid: str | None) -> str:
    """The id to use: `rid` checked, or a fresh one."""
    if rid is None:
        return f"resv-{uuid.uuid4().hex[:12]}"
    if not isinstance(rid, str) or not _ID.match(rid):
        raise SpecError(
            Violation(
                "reservation_id",
                f"is {rid!r}",
                _SECTION,
                "use 1-128 letters, digits, '.', '_', ':' or '-', starting with a letter or digit",
            )
        )
    return rid


def reservable(
    requirements: Any, timeout_s: float | None, options: Any, settings: Any
) -> tuple[MLRequirements, float]:
    """`ml.reserve`'s arguments checked: the requirements and the hold time to use."""
    if not isinstance(requirements, Mapping):
        example = 'pass a dict of ext_ml_* attributes, e.g. {"ext_ml_gpu_count": 8}'
        raise _refused("requirements", f"is {type(requirements).__name__}", example)
    req, _mlx, _warnings = requirements_of(requirements, None, options)
    if req.ext_ml_reservation_id is not None:
        fix = "leave it out: a reservation cannot sit inside another"
        raise _refused(_ATTR, "is set on a reservation's requirements", fix)
    if not any(amount for _name, amount in Demand.of(req).items()):
        fix = "ask for GPUs, CPU cores, memory or TPU chips, e.g. ext_ml_gpu_count"
        raise _refused("requirements", "reserve nothing countable", fix)
    timeout = timeout_s or req.ext_ml_reservation_timeout_s or settings.reservation_timeout_s
    if not isinstance(timeout, int | float) or not 0 < timeout <= settings.max_reservation_s:
        fix = f"use 0 < timeout_s <= ojs_ml_max_reservation_s ({settings.max_reservation_s})"
        raise _refused("timeout_s", f"is {timeout!r}", fix)
    return req, float(timeout)


def _refused(attr: str, problem: str, fix: str) -> SpecError:
    return SpecError(Violation(attr, problem, _SECTION, fix))


def pools_of(
    records: Mapping[str, Mapping[str, Any]],
    live: Mapping[str, Any],
    parse: Parse,
    now: float,
) -> list[ReservationPool]:
    """The scheduler's view of every reservation (`scheduler.pools`); bad ones are skipped."""
    out = []
    for rid, r in records.items():
        try:
            req = parse(r.get("requirements") or {})
        except Exception as exc:
            log.error("ojs-ml: skipping reservation %s: %s", rid, exc)
            continue
        worker = r.get("worker") if r.get("state") == PLACED else None
        if worker is not None and worker not in live:
            worker = None  # its worker left: place it again (jobs inside were re-published)
        held = worker is not None and rid in (
            ((live.get(worker) or {}).get("free") or {}).get("reservations") or {}
        )
        expires = r.get("expires_at")
        ended = r.get("state") == ENDED or (expires is not None and now >= float(expires))
        out.append(
            ReservationPool(
                rid,
                req,
                float(r.get("created_at") or now),
                worker,
                None if expires is None else float(expires),
                held,
                ended,
            )
        )
    return out


def held_by(
    records: Mapping[str, Mapping[str, Any]], worker: str, parse: Parse, now: float
) -> dict[str, Demand]:
    """The reservations `worker`'s gate must hold now: id -> their size."""
    out = {}
    for rid, r in records.items():
        expires = r.get("expires_at")
        if r.get("state") != PLACED or r.get("worker") != worker:
            continue
        if expires is not None and now >= float(expires):
            continue
        try:
            out[rid] = Demand.of(parse(r.get("requirements") or {}))
        except Exception as exc:
            log.error("ojs-ml: not holding reservation %s: %s", rid, exc)
    return out


def check_at_publish(
    book: ReservationBook,
    req: MLRequirements,
    static: Callable[[str], bool],
    max_hold_s: float,
    parse: Parse,
) -> None:
    """§8.3 MUST verify: the reservation exists, is not over, and can hold the job.

    A job's own `ext_ml_reservation_timeout_s` keeps its reservation held at least that
    long from its publication (it extends `expires_at`, up to `ojs_ml_max_reservation_s`);
    the reservation's own timeout is the floor."""
    rid = req.ext_ml_reservation_id
    if rid is None:
        return
    record = book.get(rid)
    if record is None:
        if static(rid):
            return
        _refuse(
            f"names reservation {rid!r}, which does not exist",
            "create it first with ml.reserve(...) or `celery ojs-ml reserve`",
        )
    assert record is not None
    expires = record.get("expires_at")
    if record.get("state") == ENDED or (expires is not None and time.time() >= float(expires)):
        _refuse(
            f"names reservation {rid!r}, which has ended ({record.get('why') or 'expired'})",
            "reserve again and publish the job with the new id",
        )
    size = Demand.of(parse(record.get("requirements") or {}))
    short = Demand.of(req).short_of(size)
    if short:
        _refuse(
            f"needs more {', '.join(short)} than reservation {rid!r} holds",
            "ask for no more than the reservation holds, or reserve more",
        )
    if req.ext_ml_reservation_timeout_s is not None and expires is not None:
        book.extend(rid, time.time() + min(float(req.ext_ml_reservation_timeout_s), max_hold_s))


def _refuse(problem: str, fix: str) -> None:
    raise SpecError(Violation(_ATTR, problem, _SECTION, f"{fix}; nothing was published"))


def _decode(raw: Any) -> dict[str, Any] | None:
    try:
        found = json.loads(raw)
    except (TypeError, ValueError):
        return None
    return found if isinstance(found, dict) else None
