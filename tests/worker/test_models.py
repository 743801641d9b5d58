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


def test_declared_vram_bounds_the_cache_but_never_evicts_the_model_just_loaded() -> None:
    task = _task(size=10, vram=20.0)
    models.model(task, "a", object, vram_gb=12.0)
    models.model(task, "b", object, vram_gb=12.0)
    assert models.loaded() == [("b", "")]
    models.model(task, "huge", object, vram_gb=40.0)
    assert models.loaded() == [("huge", "")]


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
