"""The per-child model cache's rules (`child.models`): keys, LRU by count and VRAM."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from celery_ojs_ml.child import models
from celery_ojs_ml.worker.advertising import merged


@pytest.fixture(autouse=True)
def _empty() -> Iterator[None]:
    models.clear()
    yield
    models.clear()


def _task(size: int = 2, vram: float | None = None) -> SimpleNamespace:
    settings = SimpleNamespace(model_cache_size=size, model_cache_vram_gb=vram)
    return SimpleNamespace(app=SimpleNamespace(ojs_ml=SimpleNamespace(settings=settings)),
                           request=SimpleNamespace())  # fmt: skip


def test_a_model_is_loaded_once_and_reused() -> None:
    calls: list[int] = []
    task = _task()
    first = models.model(task, ("m", "1"), lambda: calls.append(1) or object())
    again = models.model(task, ("m", "1"), lambda: calls.append(1) or object())
    assert first is again and calls == [1]


def test_the_least_recently_used_model_is_evicted_past_the_count() -> None:
    task = _task(size=2)
    for key in (("a", "1"), ("b", "1"), ("a", "1"), ("c", "1")):
        models.model(task, key, object)
    assert models.loaded() == [("a", "1"), ("c", "1")]


def test_a_model_that_does_not_fit_evicts_the_lru_model_before_its_loader_runs() -> None:
    task = _task(size=10, vram=10.0)
    models.model(task, "a", object, vram_gb=6.0)
    seen: list[list[tuple[str, str]]] = []
    models.model(task, "b", lambda: seen.append(models.loaded()) or object(), vram_gb=6.0)
    assert seen == [[]]
    assert models.loaded() == [("b", "")]


def test_models_that_fit_together_stay_and_the_lru_one_goes_first() -> None:
    task = _task(size=10, vram=10.0)
    for key in ("a", "b", "a"):
        models.model(task, key, object, vram_gb=4.0)
    seen: list[list[tuple[str, str]]] = []
    models.model(task, "c", lambda: seen.append(models.loaded()) or object(), vram_gb=4.0)
    assert seen == [[("a", "")]]
    assert models.loaded() == [("a", ""), ("c", "")]


def test_the_count_bound_evicts_before_the_loader_runs_too() -> None:
    task = _task(size=1)
    models.model(task, "a", object)
    seen: list[list[tuple[str, str]]] = []
    models.model(task, "b", lambda: seen.append(models.loaded()) or object())
    assert seen == [[]]


def test_a_model_too_large_for_the_budget_fails_before_loading_and_keeps_the_cache() -> None:
    task = _task(size=10, vram=20.0)
    models.model(task, "a", object, vram_gb=12.0)
    loads: list[int] = []
    with pytest.raises(models.ModelTooLarge) as caught:
        models.model(task, "huge", lambda: loads.append(1) or object(), vram_gb=40.0)
    assert str(caught.value) == (
        "model huge@- declares vram_gb=40 but this job's model cache holds at most 20 GB "
        "(the smaller of ojs_ml_model_cache_vram_gb and the job's ext_ml_gpu_memory_gb or "
        "GPU share); raise ojs_ml_model_cache_vram_gb or ask for more VRAM, e.g. "
        '"ext_ml_gpu_memory_gb": 40'
    )
    assert loads == [] and models.loaded() == [("a", "")]


def test_models_without_declared_vram_are_bounded_after_loading() -> None:
    task = _task(size=10, vram=10.0)
    models.model(task, "a", object, vram_gb=8.0)
    models.model(task, "b", object)
    models.model(task, "c", object, vram_gb=3.0)
    assert models.loaded() == [("b", ""), ("c", "")]


@pytest.mark.parametrize(
    ("setting", "headers", "budget"),
    [
        (None, {}, None),
        (24.0, {}, 24.0),
        (None, {"ext_ml_gpu_memory_gb": 16.0}, 16.0),
        (None, {"ext_ml_gpu_memory_gb": 16.0, "ext_ml_gpu_count": 2}, 32.0),
        (24.0, {"ext_ml_gpu_memory_gb": 16.0}, 16.0),
        (8.0, {"ext_ml_gpu_memory_gb": 16.0}, 8.0),
        (None, {"ojs_gpu_share": {"device": 0, "milli": 250, "memory_gb": 20.0}}, 20.0),
        (None, {"ojs_gpu_share": {"device": 0, "milli": 250, "memory_gb": None}}, None),
    ],
    ids=[
        "nothing declared: no VRAM bound",
        "the setting alone",
        "the job's VRAM per device",
        "times its GPU count",
        "the job's VRAM when below the setting",
        "the setting when below the job's VRAM",
        "a GPU share's VRAM",
        "a share of unknown VRAM",
    ],
)
def test_the_vram_budget_is_the_smaller_of_the_setting_and_the_jobs_vram(
    setting: float | None, headers: dict[str, object], budget: float | None
) -> None:
    task = _task(vram=setting)
    task.request = SimpleNamespace(**headers)
    assert models.vram_budget(task) == budget


def test_the_jobs_declared_vram_bounds_the_cache_without_the_setting() -> None:
    task = _task(size=10)
    task.request = SimpleNamespace(ext_ml_gpu_memory_gb=10.0)
    models.model(task, "a", object, vram_gb=6.0)
    models.model(task, "b", object, vram_gb=6.0)
    assert models.loaded() == [("b", "")]


@pytest.mark.parametrize("key", [None, "", ("m",), ("m", 1), 3])
def test_a_bad_key_is_a_type_error_naming_the_form(key: object) -> None:
    with pytest.raises(TypeError, match="model_id, model_version"):
        models.model(_task(), key, object)


def test_models_loaded_merges_static_and_live_once() -> None:
    static = [{"model_id": "s"}]
    m1 = {"model_id": "m", "model_version": "1"}
    live = {1: {"models": [m1]}, 2: {"models": [m1, {"model_id": "s"}]}}
    assert merged(static, live) == [
        {"model_id": "s"},
        {"model_id": "m", "model_version": "1"},
    ]
