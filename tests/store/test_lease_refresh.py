"""LeaseBook.refresh is a compare-and-set on each lease's token (DESIGN decision 4).

A heartbeat extends only the leases whose stored token is still the owner's.
A claim of an expired lease that lands while a refresh runs must never be
undone by the refresh writing the old token back: on a server with scripting
the check and the write are one Lua call; without it (fakeredis in the
embedded demo) they are a WATCH/MULTI transaction that starts again when a
lease changed under it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import fakeredis
import pytest
import redis
from redis.client import Pipeline

from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.registry import OJSStore

_READS = frozenset({"GET", "MGET"})
_SCRIPTS = frozenset({"EVALSHA", "EVAL"})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Race:
    """Runs `claim` once: right after the refresh's first read, or just before its script.

    A script reads and writes at once, so "just before" is the latest a claim
    can land on that path; on the other paths it lands between read and write.
    """

    def __init__(self) -> None:
        self.claim: Callable[[], None] | None = None
        self.fired_on: str | None = None

    def around(self, name: str, run: Callable[[], Any]) -> Any:
        if name in _SCRIPTS:
            self._fire(name)
        result = run()
        if name in _READS:
            self._fire(name)
        return result

    def _fire(self, name: str) -> None:
        if self.claim is not None and self.fired_on is None:
            self.fired_on = name
            self.claim()


class RacingPipeline(Pipeline):
    race: Race

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        run: Callable[..., Any] = super().execute_command
        immediate = (self.watching or args[0] == "WATCH") and not self.explicit_transaction
        if not immediate:
            return run(*args, **kwargs)
        return self.race.around(str(args[0]), lambda: run(*args, **kwargs))


class RacingRedis(redis.Redis):
    """A client whose reads (and scripts) let a claim slip in, once (see `Race`)."""

    race: Race

    def execute_command(self, *args: Any, **options: Any) -> Any:
        run: Callable[..., Any] = super().execute_command
        return self.race.around(str(args[0]), lambda: run(*args, **options))

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        pipe = RacingPipeline(
            self.connection_pool, self.response_callbacks, transaction, shard_hint
        )
        pipe.race = self.race
        return pipe


class RacingFakeRedis(RacingRedis, fakeredis.FakeRedis):
    """The same on fakeredis, which has no Lua here (the embedded demo's store)."""


def _books(mode: str, redis_url: str, clock: Clock) -> tuple[LeaseBook, LeaseBook, Race]:
    """(the owner's book on a racing client, a claimer's book on a plain one, the race)."""
    race = Race()
    if mode == "fakeredis":
        server = fakeredis.FakeServer()
        owner_client: redis.Redis = RacingFakeRedis(server=server)
        other_client: redis.Redis = fakeredis.FakeRedis(server=server)
    else:
        owner_client = RacingRedis.from_url(redis_url)
        other_client = redis.Redis.from_url(redis_url)
    owner_client.race = race  # type: ignore[attr-defined]
    owner = LeaseBook(OJSStore(owner_client, prefix="rf", clock=clock), ttl_s=30)
    claimer = LeaseBook(OJSStore(other_client, prefix="rf", clock=clock), ttl_s=30)
    if mode != "lua":
        owner._scripts = claimer._scripts = None
    return owner, claimer, race


def _record(task_id: str = "job-1", worker: str = "a@x") -> dict[str, Any]:
    return {"task_id": task_id, "worker": worker, "incarnation": "i1", "devices": [0]}


@pytest.mark.parametrize("mode", ["lua", "multi", "fakeredis"])
def test_a_claim_that_lands_during_a_refresh_is_never_undone(
    mode: str, redis_url: str, redis_client: redis.Redis
) -> None:
    """DESIGN decision 4 / invariant 5: the old token is never written back."""
    clock = Clock()
    owner, claimer, race = _books(mode, redis_url, clock)
    token = owner.take(_record())
    clock.now = 1031.0  # the owner stalled past its deadline; a claimer sees it expired
    claimed: list[dict[str, Any] | None] = []
    race.claim = lambda: claimed.append(claimer.claim("job-1", "b@x", "i2"))

    taken, missing = owner.refresh({"job-1": token})

    assert race.fired_on == ("EVALSHA" if mode == "lua" else "MGET"), "it ran during the refresh"
    [won] = claimed
    assert won is not None, "the lease had expired: the claimer wins it"
    assert (taken, missing) == (["job-1"], [])
    lease = claimer.get("job-1")
    assert lease is not None
    assert lease["token"] == won["claim_token"] != token
    assert lease["worker"] == "b@x" and lease["claimed_from"] == "a@x"
    assert lease["deadline"] == 1061.0


@pytest.fixture(params=["lua", "multi", "fakeredis"])
def book(request: pytest.FixtureRequest, redis_url: str, redis_client: redis.Redis) -> Any:
    clock = Clock()
    owner, claimer, _ = _books(request.param, redis_url, clock)
    return owner, claimer, clock


def test_refresh_extends_only_our_leases_and_reports_taken_and_missing_ones(book: Any) -> None:
    owner, claimer, clock = book
    mine = owner.take(_record("mine"))
    old = owner.take(_record("lost"))
    clock.now = 1031.0
    won = claimer.claim("lost", "b@x", "i2")
    assert won is not None
    clock.now = 1040.0

    taken, missing = owner.refresh({"mine": mine, "lost": old, "gone": "t-gone"})

    assert (taken, missing) == (["lost"], ["gone"])
    extended = owner.get("mine")
    assert extended is not None and extended["token"] == mine and extended["deadline"] == 1070.0
    untouched = owner.get("lost")
    assert untouched is not None and untouched["token"] == won["claim_token"]
    assert untouched["deadline"] == 1061.0, "another worker's lease keeps its own deadline"
    clock.now = 1065.0
    assert owner.expired() == ["lost"], "the index follows each lease's deadline"
    assert owner.refresh({}) == ([], [])


def test_refresh_changes_nothing_in_a_lease_but_its_deadline(book: Any) -> None:
    """A refresh must not re-encode the job: `[]` must not become `{}`, floats keep every digit."""
    owner, _, clock = book
    record = {**_record("exact"), "args": [], "kwargs": {"lr": 0.1 + 0.2, "deadline": 7}}
    token = owner.take(record)
    clock.now = 1010.0
    assert owner.refresh({"exact": token}) == ([], [])
    lease = owner.get("exact")
    assert lease == {**record, "token": token, "fed": 1, "deadline": 1040.0}


def test_refresh_extends_a_lease_whose_deadline_is_not_its_last_field(book: Any) -> None:
    """A lease written in another layout (an older release) is still ours to extend."""
    owner, _, clock = book
    key = owner.store.lease_key("older")
    lease = {"task_id": "older", "deadline": 1030.0, "token": "t-old", "claimed_from": "z@x"}
    owner.store.client.set(key, json.dumps(lease))
    owner.store.client.zadd(owner._index, {"older": 1030.0})
    clock.now = 1020.0
    assert owner.refresh({"older": "t-old"}) == ([], [])
    assert owner.get("older") == {**lease, "deadline": 1050.0}
    clock.now = 1040.0
    assert owner.expired() == []


def test_on_a_server_with_scripting_a_refresh_is_one_script_call(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Read, token check and write are one atomic step: nothing can slip in between."""
    clock = Clock()
    owner, _, _ = _books("lua", redis_url, clock)
    tokens = {f"job-{i}": owner.take(_record(f"job-{i}")) for i in range(3)}
    owner.refresh(tokens)  # loads the script
    redis_client.config_resetstat()
    assert owner.refresh(tokens) == ([], [])
    stats: dict[str, Any] = redis_client.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): v["calls"] for name, v in stats.items()}
    assert calls.get("evalsha") == 1
    assert not {"mget", "watch", "multi", "exec"} & calls.keys(), calls
