"""Dedup option checks and keys (OJS ML §14.6), without a broker."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.producer.dedup import key_of, window_of


@pytest.mark.parametrize("opts", [{}, {"window_s": 0}, {"window_s": True}, 30, {"window_s": "5"}])
def test_a_bad_ml_dedup_option_is_a_config_error_naming_it(opts: object) -> None:
    with pytest.raises(ConfigError, match="ml_dedup"):
        window_of(SimpleNamespace(name="t", ml_dedup=opts))


def test_the_default_key_depends_on_the_task_and_its_arguments_only() -> None:
    assert key_of("t", [1], {"a": 2}) == key_of("t", (1,), {"a": 2})
    assert key_of("t", [1], {}) != key_of("t", [2], {})
    assert key_of("t", [1], {}) != key_of("u", [1], {})
    assert key_of("t", [object()], {}).startswith("t:")  # not JSON: repr
