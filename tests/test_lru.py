"""Every memo the plugin keeps in a long-lived process is bounded."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_ojs_ml import OJSML
from celery_ojs_ml.lru import LRU
from celery_ojs_ml.producer.routing import MLRouter
from celery_ojs_ml.spec.classes import class_id
from celery_ojs_ml.spec.normalize import DEFAULT_BOUNDS, normalize
from celery_ojs_ml.wire.inbound import BadMessage, InboundCheck


def test_an_lru_keeps_at_most_maxsize_entries_and_drops_the_least_recently_used() -> None:
    cache: LRU[str, int] = LRU(3)
    for i, key in enumerate("abc"):
        cache[key] = i
    assert cache.get("a") == 0  # now the most recently used
    cache["d"] = 3
    assert (len(cache), "b" in cache, cache.get("a"), cache.get("d")) == (3, False, 0, 3)


def test_an_lru_of_size_zero_is_refused_with_an_example() -> None:
    with pytest.raises(ValueError, match=r"LRU\(1024\)"):
        LRU(0)


def _job(uri: str) -> dict[str, object]:
    attrs = {
        "ext_ml_gpu_count": 1,
        "ext_ml_checkpoint_enabled": True,
        "ext_ml_checkpoint_storage_uri": uri,
    }
    return {"ojs_class": class_id(normalize(attrs).requirements), **attrs}


def test_the_gate_memo_stays_bounded_with_a_checkpoint_uri_per_run() -> None:
    admission = InboundCheck(DEFAULT_BOUNDS, 65536)
    for run in range(1500):
        assert admission.requirements(_job(f"s3://ckpt/run-{run}/")) is not None
    assert admission.cache_size() == 1024


def test_the_gate_drops_headers_only_it_may_set_even_on_plain_tasks() -> None:
    headers = {"ojs_devices": [3], "ojs_pin": True, "ojs_node": "x", "ojs_lease": 5, "a": 1}
    assert InboundCheck(DEFAULT_BOUNDS, 65536).requirements(headers) is None
    assert headers == {"a": 1}


def test_a_requirement_header_over_the_size_bound_is_refused_naming_the_setting() -> None:
    headers = _job("s3://ckpt/x/")
    headers["ext_ml_model_id"] = "m" * 5000
    with pytest.raises(BadMessage, match="ojs_ml_max_header_bytes"):
        InboundCheck(DEFAULT_BOUNDS, 4096).requirements(headers)


def test_the_router_memo_and_the_eligibility_memo_stay_bounded() -> None:
    app = Celery("lru", broker="memory://", set_as_current=False)
    plugin = OJSML(app)
    router = next(r for r in app.conf.task_routes if isinstance(r, MLRouter))
    for run in range(1500):
        router._resolve({"ext_ml_gpu_count": 1, "ext_ml_model_id": f"m-{run}"}, "celery")
    assert len(router._memo) == 1024
    assert plugin.eligibility._eligible.maxsize == 4096
