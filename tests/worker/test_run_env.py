"""A job's working directory and environment (Flux RFC 25 §Attributes) at the worker: the
gate's check (`worker.run_env`) and the pool child's set and restore (`child.run_env`)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from celery_ojs_ml.child.run_env import restore_run_env, set_run_env
from celery_ojs_ml.spec.bounds import DEFAULT_BOUNDS
from celery_ojs_ml.spec.classes import class_id
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.inbound import BadMessage
from celery_ojs_ml.worker.run_env import RunEnvCheck

ATTRS = {"ext_ml_cpu_cores": 1}


def headers(**extra: Any) -> dict[str, Any]:
    return {h.CLASS: class_id(normalize(ATTRS).requirements), **ATTRS, **extra}


def test_the_gate_admits_a_job_whose_cwd_exists_here(tmp_path: Path) -> None:
    check = RunEnvCheck(DEFAULT_BOUNDS, 65536, prefork=True)
    found = headers(**{h.CWD: str(tmp_path), h.ENVIRONMENT: {"FOO": "bar"}})
    assert check.requirements(found) is not None


@pytest.mark.parametrize(
    ("extra", "prefork", "words"),
    [
        ({h.CWD: "/no/such/dir/here"}, True, "'/no/such/dir/here' is not a directory on this"),
        ({h.ENVIRONMENT: {"RANK": "3"}}, True, "environment.RANK is set by the worker"),
        ({h.ENVIRONMENT: "FOO=1"}, True, 'environment is "FOO=1" but must be a mapping'),
        ({h.ENVIRONMENT: {"FOO": "1"}}, False, "need the prefork pool"),
    ],
    ids=["a missing directory", "a plugin variable", "a forged header", "a threads pool"],
)
def test_the_gate_refuses_a_job_it_cannot_give_its_cwd_or_environment_flux_rfc25(
    extra: dict[str, Any], prefork: bool, words: str
) -> None:
    with pytest.raises(BadMessage, match=r"attributes\.system") as found:
        RunEnvCheck(DEFAULT_BOUNDS, 65536, prefork=prefork).requirements(headers(**extra))
    assert words in str(found.value)


def test_plain_tasks_are_never_checked() -> None:
    plain = {h.CWD: "/no/such/dir", "a": 1}
    assert RunEnvCheck(DEFAULT_BOUNDS, 65536, prefork=True).requirements(plain) is None


def _request(**extra: Any) -> SimpleNamespace:
    return SimpleNamespace(id="job-1", **{h.PIN: True, **extra})


def test_the_child_sets_both_for_the_run_and_puts_them_back_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEEP", "before")
    monkeypatch.delenv("FOO", raising=False)
    start = os.getcwd()
    request = _request(**{h.CWD: str(tmp_path), h.ENVIRONMENT: {"FOO": "1", "KEEP": "job"}})
    set_run_env(request)
    during = (os.getcwd(), os.environ.get("FOO"), os.environ.get("KEEP"))
    restore_run_env(request)
    assert during == (str(tmp_path), "1", "job")
    assert (os.getcwd(), os.environ.get("FOO"), os.environ.get("KEEP")) == (start, None, "before")


def test_the_child_leaves_a_run_without_pinning_or_with_a_forged_header_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FOO", raising=False)
    start = os.getcwd()
    unpinned = _request(**{h.PIN: False, h.CWD: str(tmp_path), h.ENVIRONMENT: {"FOO": "1"}})
    forged = _request(**{h.ENVIRONMENT: {"FOO": "1", "CUDA_VISIBLE_DEVICES": "7"}})
    for request in (unpinned, forged):
        set_run_env(request)
        assert (os.getcwd(), os.environ.get("FOO")) == (start, None)
        restore_run_env(request)
