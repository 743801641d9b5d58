"""The leader's fair-share memory (`ojs_ml_fair_share_half_life_s`): kept, persisted, continued.

The decayed usage is advanced once per pass from the GPUs each queue holds (running and
assigned); a new leader reads what the last one wrote and continues it, decayed over the
time between (Slurm's `PriorityDecayHalfLife`). Driven on an injected clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import fakeredis
import pytest

from celery_ojs_ml.leader.fair_usage import FairUsage
from celery_ojs_ml.leader.pass_state import PassState
from celery_ojs_ml.scheduler import Policy
from celery_ojs_ml.store.registry import OJSStore
from tests.scheduler.helpers import running, worker

HALF_LIFE = 600.0
POLICY = Policy(weights=(("a", 1.0), ("b", 1.0)), fair_share_half_life_s=HALF_LIFE)


def _state(now: float, a_gpus: int, inflight: Sequence[tuple[str, int]] = ()) -> PassState:
    jobs = [running(f"r{i}", gpu_count=1, queue="a") for i in range(a_gpus)]
    state = PassState(now)
    state.fleet = [worker("w", jobs=jobs)]
    state.inflight = list(inflight)
    return state


def test_a_new_leader_continues_the_usage_the_last_one_persisted() -> None:
    store = OJSStore(fakeredis.FakeRedis(), prefix="t")
    first = FairUsage(store, POLICY)
    first.hello()
    first.advance(_state(0.0, 4))
    held = first.advance(_state(HALF_LIFE, 4))
    assert held is not None and held["a"] == pytest.approx(4 * 0.5)  # G * (1 - 2^-1)
    after = FairUsage(store, POLICY)
    after.hello()
    continued = after.advance(_state(2 * HALF_LIFE, 4))
    assert continued is not None and continued["a"] == pytest.approx(4 * 0.75)


def test_assigned_jobs_count_as_held() -> None:
    keeper = FairUsage(OJSStore(fakeredis.FakeRedis(), prefix="t"), POLICY)
    keeper.advance(_state(0.0, 0, [("b", 2)]))
    held = keeper.advance(_state(HALF_LIFE, 0, [("b", 2)]))
    assert held is not None and held["b"] == pytest.approx(2 * 0.5)


def test_without_a_half_life_nothing_is_kept_or_written() -> None:
    client = fakeredis.FakeRedis()
    keeper = FairUsage(OJSStore(client, prefix="t"), Policy(weights=(("a", 1.0),)))
    keeper.hello()
    assert keeper.advance(_state(0.0, 4)) is None
    assert client.keys("*") == []
