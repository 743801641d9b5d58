"""A grant holder's read-ahead (`Grants.sync_prefetch`, `granted_raise`), on kombu's own QoS.

Without a grant the consumer's window is Celery's plus `ojs_ml_prefetch` (room for the jobs
the leader delivers ahead). With one, it keeps only what leaves one job ready beyond those
the pool can run, so a granted burst does not wait at the gate where plain Celery's pool
buffer would hold it."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

from celery.worker.consumer.consumer import Consumer
from kombu.common import QoS

from celery_ojs_ml.worker.granted import Grants


def _holder(processes: Any, multiplier: Any, gpus: int, prefetch: int = 2) -> Grants:
    g = Grants.__new__(Grants)
    qos = QoS(lambda prefetch_count: None, processes * multiplier)
    g.c = SimpleNamespace(
        qos=qos, pool=SimpleNamespace(num_processes=processes), prefetch_multiplier=multiplier
    )
    g.settings = SimpleNamespace(prefetch=prefetch)  # type: ignore[assignment]
    g.caps = SimpleNamespace(gpu_count=gpus)  # type: ignore[assignment]
    g.mine, g.prefetch_raise = {}, 0
    return g


def _window(g: Grants) -> int:
    value: int = g.c.qos.value
    return value


def test_without_a_grant_the_window_is_celerys_plus_ojs_ml_prefetch() -> None:
    g = _holder(2, 4, 8, prefetch=2)
    g.sync_prefetch()
    assert _window(g) == 10


def test_a_holder_whose_window_covers_its_processes_reads_no_further_than_celery() -> None:
    g = _holder(2, 4, 8)
    g.sync_prefetch()
    g.mine = {"bench|on-demand|cls": "e1"}
    g.sync_prefetch()
    assert _window(g) == 8  # 2 running, 6 ready: as plain Celery
    g.mine = {}
    g.sync_prefetch()
    assert _window(g) == 10  # the grant ended: room for jobs delivered ahead again


def test_a_holder_with_one_process_per_gpu_and_multiplier_1_keeps_one_job_ready() -> None:
    g = _holder(4, 1, 4)
    g.sync_prefetch()
    g.mine = {"q|spot|c": "e2"}
    g.sync_prefetch()
    assert _window(g) == 5  # 4 running + 1 ready at the gate


def test_a_gpu_less_holder_counts_every_process_as_running() -> None:
    g = _holder(3, 1, 0)
    g.mine = {"q|spot|c": "e3"}
    g.sync_prefetch()
    assert _window(g) == 4


def test_an_unknown_pool_keeps_the_whole_raise() -> None:
    g = _holder(2, 4, 8)
    g.c.pool = None
    g.mine = {"q|spot|c": "e4"}
    g.sync_prefetch()
    assert _window(g) == 10


def test_ojs_ml_prefetch_0_never_raises_the_window() -> None:
    g = _holder(1, 1, 1, prefetch=0)
    for mine in ({}, {"q|spot|c": "e5"}, {}):
        g.mine = mine
        g.sync_prefetch()
        assert _window(g) == 1


def test_nothing_is_changed_before_the_consumer_qos_is_known() -> None:
    g = _holder(2, 4, 8)
    g.prefetch_raise = None  # `init_grants` reads the grants before `_open_prefetch`
    g.sync_prefetch()
    assert _window(g) == 8


def test_celerys_window_is_processes_times_the_multiplier() -> None:
    """celery 5.7.0: `granted_raise` reads the window as `Consumer._update_prefetch_count`
    sets it; this fails when that changes."""
    src = inspect.getsource(Consumer._update_prefetch_count)
    assert "self.pool.num_processes * self.prefetch_multiplier" in src
    assert "prefetch_multiplier" in inspect.signature(Consumer.__init__).parameters
