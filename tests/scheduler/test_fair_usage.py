"""Fair share with memory (`ojs_ml_fair_share_half_life_s`): Slurm's decayed usage."""

from __future__ import annotations

import math

import pytest

from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.scheduler import Decision, PendingJob, Policy, schedule
from celery_ojs_ml.scheduler.fair import decayed_split, weighted_split
from celery_ojs_ml.scheduler.usage import Usage, decay
from celery_ojs_ml.wire.settings import read_settings
from tests.scheduler.helpers import NOW, job, running, worker

BOTH = frozenset({"a", "b"})
EVEN = (("a", 1.0), ("b", 1.0))


def _queues(decision: Decision, pending: list[PendingJob]) -> dict[str, int]:
    by_id = {j.task_id: j.queue for j in pending}
    out: dict[str, int] = {}
    for a in decision.assignments:
        out[by_id[a.task_id]] = out.get(by_id[a.task_id], 0) + 1
    return out


def test_usage_halves_every_half_life() -> None:
    assert decay(3600, 3600) == pytest.approx(0.5)
    assert decay(7200, 3600) == pytest.approx(0.25)
    start = Usage(3600, at=0.0, gpu_s={"a": 1000.0}, held={})
    assert start.advance(3600, {}).gpu_s["a"] == pytest.approx(500.0)
    assert start.advance(7200, {}).gpu_s["a"] == pytest.approx(250.0)


def test_usage_adds_the_gpus_held_since_the_last_advance_decayed_exactly() -> None:
    """Holding G GPUs for dt adds G * tau * (1 - 2^(-dt/h)): the integral of G * 2^(-age/h)."""
    h, g, dt = 600.0, 4.0, 300.0
    u = Usage(h).advance(0.0, {"a": g}).advance(dt, {"a": g})
    tau = h / math.log(2)
    assert u.gpu_s["a"] == pytest.approx(g * tau * (1 - 2 ** (-dt / h)))
    # the same hold in many short steps gives the same usage: the update composes
    steps = Usage(h).advance(0.0, {"a": g})
    for i in range(1, 31):
        steps = steps.advance(i * dt / 30, {"a": g})
    assert steps.gpu_s["a"] == pytest.approx(u.gpu_s["a"])


def test_a_queue_holding_g_gpus_for_ever_tends_to_a_decayed_mean_of_g() -> None:
    u = Usage(60.0).advance(0.0, {"a": 3.0}).advance(6000.0, {"a": 3.0})
    assert u.mean_gpus()["a"] == pytest.approx(3.0, rel=1e-6)


def test_the_fair_share_factor_is_slurms_classic_formula() -> None:
    """F = 2^(-U_norm / S_norm): 1 with no usage, 0.5 at exactly its share."""
    u = Usage(3600, at=0.0, gpu_s={"a": 300.0, "b": 100.0})
    f = u.factors({"a": 1.0, "b": 1.0})
    assert f["a"] == pytest.approx(2 ** (-0.75 / 0.5))
    assert f["b"] == pytest.approx(2 ** (-0.25 / 0.5))
    even = Usage(3600, at=0.0, gpu_s={"a": 200.0, "b": 100.0}).factors({"a": 2.0, "b": 1.0})
    assert even == pytest.approx({"a": 0.5, "b": 0.5})
    assert Usage(3600).factors({"a": 1.0}) == {"a": 1.0}


def test_usage_survives_a_round_trip_through_its_json_and_bad_json_reads_as_empty() -> None:
    u = Usage(900).advance(5.0, {"a": 2.0}).advance(65.0, {"a": 1.0, "b": 3.0})
    back = Usage.loads(u.dumps(), 900)
    assert (back.at, dict(back.gpu_s), dict(back.held)) == (u.at, dict(u.gpu_s), dict(u.held))
    assert Usage.loads(b"not json", 900) == Usage(900)
    assert Usage.loads(None, 900) == Usage(900)


def test_a_clock_that_goes_back_neither_grows_nor_decays_usage() -> None:
    u = Usage(600, at=100.0, gpu_s={"a": 50.0}, held={"a": 2.0})
    assert u.advance(90.0, {"a": 2.0}).gpu_s["a"] == pytest.approx(50.0)


def test_a_queue_that_used_the_fleet_before_gives_way_to_one_that_did_not() -> None:
    """8 free GPUs, weights 1:1, both queues flooding. Without memory they split 4:4;
    with `a` having held 8 GPUs on average lately, `b` takes all 8 (its count 0 + 8 stays
    below a's 8 + 0 until the last GPU), and at a decayed mean of 4 for `a`, b gets 6."""
    pending = [job(f"a{i}", at=i, gpu_count=1, queue="a") for i in range(10)]
    pending += [job(f"b{i}", at=100 + i, gpu_count=1, queue="b") for i in range(10)]
    fleet = [worker("w", queues=BOTH)]
    plain = schedule(pending, fleet, NOW, Policy(weights=EVEN))
    assert _queues(plain, pending) == {"a": 4, "b": 4}
    memory = Policy(weights=EVEN, fair_share_half_life_s=600.0)
    flooded = schedule(pending, fleet, NOW, memory, usage={"a": 8.0})
    assert _queues(flooded, pending) == {"b": 8}
    half = schedule(pending, fleet, NOW, memory, usage={"a": 4.0})
    assert _queues(half, pending) == {"a": 2, "b": 6}


def test_usage_is_ignored_without_a_half_life() -> None:
    pending = [job(f"a{i}", at=i, gpu_count=1, queue="a") for i in range(10)]
    pending += [job(f"b{i}", at=100 + i, gpu_count=1, queue="b") for i in range(10)]
    fleet = [worker("w", queues=BOTH)]
    decision = schedule(pending, fleet, NOW, Policy(weights=EVEN), usage={"a": 8.0})
    assert _queues(decision, pending) == {"a": 4, "b": 4}


def test_on_a_steady_fleet_memory_orders_as_without() -> None:
    """A queue holding G GPUs steadily has a decayed mean of G: counts 2G against 2G'."""
    held = [running(f"r{i}", gpu_count=1, queue="a", limit=60) for i in range(2)]
    held += [running(f"s{i}", gpu_count=1, queue="b", limit=60) for i in range(4)]
    pending = [job(f"a{i}", at=i, gpu_count=1, queue="a") for i in range(4)]
    pending += [job(f"b{i}", at=100 + i, gpu_count=1, queue="b") for i in range(4)]
    fleet = [worker("w", queues=BOTH, jobs=held)]
    memory = Policy(weights=EVEN, fair_share_half_life_s=600.0)
    steady = schedule(pending, fleet, NOW, memory, usage={"a": 2.0, "b": 4.0})
    plain = schedule(pending, fleet, NOW, Policy(weights=EVEN))
    assert _queues(steady, pending) == _queues(plain, pending) == {"a": 2}


def test_the_decayed_split_is_what_fair_order_with_memory_converges_to() -> None:
    """8 GPUs, 1:1, `a` at a decayed mean of 4: levels equal at a: 2, b: 6. Without
    memory it is the weighted split."""
    split = decayed_split(8, {"a": 10, "b": 10}, {"a": 1.0, "b": 1.0}, {"a": 4.0})
    assert split == pytest.approx({"a": 2.0, "b": 6.0})
    assert decayed_split(8, {"a": 10, "b": 10}, {}, {"a": 9.0}) == pytest.approx(
        {"a": 0.0, "b": 8.0}
    )
    demand, weights = {"a": 12.0, "b": 1.0, "c": 0.0}, {"a": 1.0, "b": 3.0}
    assert decayed_split(8, demand, weights, {}) == pytest.approx(
        weighted_split(8, demand, weights)
    )


def test_a_half_life_without_fair_share_weights_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="ojs_ml_fair_share"):
        read_settings({"ojs_ml_fair_share_half_life_s": 3600})
    found = read_settings({"ojs_ml_fair_share_half_life_s": 3600, "ojs_ml_fair_share": {"a": 1}})
    assert Policy.from_settings(found).fair_share_half_life_s == 3600
    with pytest.raises(ConfigError, match="fair_share_half_life_s"):
        read_settings({"ojs_ml_fair_share_half_life_s": -1, "ojs_ml_fair_share": {"a": 1}})
