"""Pool-child retirement (DESIGN decision 3) and the `ojs_ml_recycle_gpu_children` setting."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import billiard.pool as bpool
import pytest

from celery_ojs_ml.child import pinning as child
from celery_ojs_ml.child.hooks import POOL_CHILDREN
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.testing import fake_cuda
from celery_ojs_ml.wire.settings import read_settings
from celery_ojs_ml.worker.core import configure_child_recycling

MAPS = "7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/{name}\n"


def _maps(tmp_path: Path, *names: str) -> str:
    path = tmp_path / "maps"
    path.write_text("".join(MAPS.format(name=n) for n in names))
    return str(path)


def test_cuda_counts_as_initialised_once_the_driver_library_is_mapped(tmp_path: Path) -> None:
    assert child.cuda_initialised(_maps(tmp_path, "libcuda.so.535.104.05", "libc.so.6"))
    assert not child.cuda_initialised(_maps(tmp_path, "libcudart.so.12", "libnvidia-ml.so.1"))


def test_an_unreadable_maps_file_means_assume_the_worst(tmp_path: Path) -> None:
    assert child.cuda_initialised(str(tmp_path / "missing"))


def test_the_load_count_grows_when_a_shared_object_is_loaded(tmp_path: Path) -> None:
    import ctypes
    import shutil

    before = child.loaded_objects()
    assert isinstance(before, int) and before > 0  # glibc on this machine
    assert child.loaded_objects() == before  # nothing loaded in between
    copy = tmp_path / "libfake.so"
    shutil.copy(fake_cuda.shared_object(), copy)
    ctypes.CDLL(str(copy))
    after = child.loaded_objects()
    assert after is not None and after > before


def test_the_driver_watch_reads_the_maps_only_after_a_new_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[int] = []
    state = {"loads": 5, "cuda": False}
    monkeypatch.setattr(child, "loaded_objects", lambda: state["loads"])

    def maps(path: str = "") -> bool:
        reads.append(1)
        return state["cuda"]

    monkeypatch.setattr(child, "cuda_initialised", maps)
    watch = child.DriverWatch()
    assert not watch() and len(reads) == 1
    assert not watch() and len(reads) == 1  # same load count: no read
    state["loads"], state["cuda"] = 6, True
    assert watch() and len(reads) == 2
    assert watch() and len(reads) == 3  # once found, it stays found (never cached as clean)
    monkeypatch.setattr(child, "loaded_objects", lambda: None)  # unknown count: always read
    state["cuda"] = False
    assert not watch() and not watch() and len(reads) == 5


def test_this_billiard_has_the_hook_retirement_rides_on() -> None:
    assert child.billiard_can_retire()


@pytest.fixture
def restore_billiard() -> Any:
    saved = {
        name: getattr(bpool, name)
        for name in (
            "mem_rss",
            "warning",
            "GUARANTEE_MESSAGE_CONSUMPTION_RETRY_INTERVAL",
            "GUARANTEE_MESSAGE_CONSUMPTION_RETRY_LIMIT",
        )
    }
    yield
    for name, value in saved.items():
        setattr(bpool, name, value)


def test_the_retirement_hook_reports_real_memory_until_cuda_is_initialised(
    monkeypatch: pytest.MonkeyPatch, restore_billiard: Any
) -> None:
    state = {"cuda": False, "loads": 10}
    monkeypatch.setattr(child, "cuda_initialised", lambda maps="": state["cuda"])
    monkeypatch.setattr(child, "loaded_objects", lambda: state["loads"])
    monkeypatch.setattr(bpool, "mem_rss", lambda: 1234)
    total = (
        bpool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_INTERVAL
        * bpool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_LIMIT
    )
    child.install_cuda_retirement()
    assert bpool.mem_rss() == 1234  # a user's own max_memory_per_child still works
    state["loads"] += 1  # the driver cannot initialise without loading a shared object
    state["cuda"] = True
    assert bpool.mem_rss() == child.RETIRE_KB > child.NO_LIMIT_KB
    # The exit poll is faster but waits as long in all.
    poll = bpool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_INTERVAL
    assert poll < 0.1
    assert poll * bpool.GUARANTEE_MESSAGE_CONSUMPTION_RETRY_LIMIT == pytest.approx(total, rel=0.01)


@pytest.fixture(autouse=True)
def restore_mode() -> Any:
    saved = dict(child.RECYCLE)
    yield
    child.RECYCLE.clear()
    child.RECYCLE.update(saved)


def _conf(**values: Any) -> SimpleNamespace:
    base = {
        "worker_pool": "prefork",
        "worker_max_tasks_per_child": None,
        "worker_max_memory_per_child": None,
    }
    return SimpleNamespace(**{**base, **values})


def _instance(mode: str) -> SimpleNamespace:
    plugin = SimpleNamespace(settings=read_settings({"ojs_ml_recycle_gpu_children": mode}))
    return SimpleNamespace(app=SimpleNamespace(ojs_ml=plugin))


GPU = {"ojs_ml_capabilities": "profile:nvidia-a100x2"}


def test_cuda_mode_turns_on_billiards_per_task_memory_check() -> None:
    conf = _conf()
    configure_child_recycling(
        children=POOL_CHILDREN, conf=conf, options=dict(GPU), instance=_instance("cuda")
    )
    assert child.RECYCLE["mode"] == "cuda"
    assert conf.worker_max_memory_per_child == child.NO_LIMIT_KB
    assert conf.worker_max_tasks_per_child is None


def test_cuda_mode_keeps_a_users_memory_limit() -> None:
    conf = _conf(worker_max_memory_per_child=500_000)
    configure_child_recycling(
        children=POOL_CHILDREN, conf=conf, options=dict(GPU), instance=_instance("cuda")
    )
    assert conf.worker_max_memory_per_child == 500_000


def test_always_mode_runs_one_task_per_child() -> None:
    conf = _conf(worker_max_tasks_per_child=50)
    configure_child_recycling(
        children=POOL_CHILDREN, conf=conf, options=dict(GPU), instance=_instance("always")
    )
    assert (child.RECYCLE["mode"], conf.worker_max_tasks_per_child) == ("always", 1)


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        ("never", GPU),
        ("cuda", {"ojs_ml_capabilities": "profile:cpu"}),
        ("cuda", {**GPU, "pool_cls": "threads"}),
    ],
)
def test_nothing_is_recycled_without_gpus_prefork_or_when_turned_off(
    mode: str, options: dict[str, Any]
) -> None:
    conf = _conf()
    configure_child_recycling(
        children=POOL_CHILDREN, conf=conf, options=dict(options), instance=_instance(mode)
    )
    assert child.RECYCLE["mode"] == "never"
    assert conf.worker_max_memory_per_child is None and conf.worker_max_tasks_per_child is None


def test_the_setting_takes_booleans_and_rejects_other_values() -> None:
    assert read_settings({"ojs_ml_recycle_gpu_children": True}).recycle_gpu_children == "cuda"
    assert read_settings({"ojs_ml_recycle_gpu_children": False}).recycle_gpu_children == "never"
    with pytest.raises(ConfigError, match="recycle_gpu_children"):
        read_settings({"ojs_ml_recycle_gpu_children": "sometimes"})


def test_the_child_hooks_are_one_receiver_per_signal_and_none_on_task_success() -> None:
    """Celery sends a signal per task only when it has receivers: the child's work is one
    `task_prerun` and one `task_postrun` receiver, and `task_success` carries none."""
    from celery import Celery, signals

    from celery_ojs_ml import OJSML

    OJSML(Celery("hooks", broker="memory://", set_as_current=False))

    def ours(signal: Any) -> list[str]:
        found = [
            r() if callable(r) and not hasattr(r, "__code__") else r for *_, r in signal.receivers
        ]
        return [f.__qualname__ for f in found if "celery_ojs_ml" in getattr(f, "__module__", "")]

    assert ours(signals.task_prerun) == ["child_prerun"]
    assert ours(signals.task_postrun) == ["child_postrun"]
    assert ours(signals.task_success) == []


def _rank_task(stored: list[tuple[str, Any, str]]) -> Any:
    from celery_ojs_ml.wire.headers import RENDEZVOUS as HEADER_RENDEZVOUS

    request = SimpleNamespace(id="rank-0", **{HEADER_RENDEZVOUS: {"size": 2}})
    backend = SimpleNamespace(
        store_result=lambda tid, res, state, request: stored.append((tid, res, state))
    )
    return SimpleNamespace(request=request, backend=backend)


def test_postrun_stores_a_gang_ranks_result_on_success_only() -> None:
    """A gang rank runs with `ignore_result`; its success is stored by the child's
    `task_postrun` (the `task_success` receiver it replaced), its failure is not."""
    from celery_ojs_ml.child.hooks import child_postrun as _child_postrun

    stored: list[tuple[str, Any, str]] = []
    _child_postrun(task=_rank_task(stored), retval=41, state="FAILURE")
    assert stored == []
    _child_postrun(task=_rank_task(stored), retval=42, state="SUCCESS")
    assert stored == [("rank-0", 42, "SUCCESS")]
