"""TPU chips are pinned like GPUs (OJS ML §3.3): the gate picks chip indices from the
allocation (`worker.tpu_chips`), the pool child selects exactly them for the task
body and puts the environment back afterwards (`child.tpu_env`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.child import pinning
from celery_ojs_ml.child.tpu_env import NAMES, tpu_env
from celery_ojs_ml.spec.bounds import DEFAULT_BOUNDS
from celery_ojs_ml.testing.builders import worker_with
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.inbound import InboundCheck
from celery_ojs_ml.worker.tpu_chips import assign_chips, pick_chips


@pytest.fixture(autouse=True)
def _clean_env() -> Iterator[None]:
    """No TPU or CUDA variable set before a test, and none left behind by it."""
    names = (*NAMES, pinning.CVD, pinning.ORDER)
    saved = {name: os.environ.pop(name, None) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _tpu_worker(chips: int = 16) -> Capabilities:
    return worker_with(tpu={"type": "v5e", "topology": "4x4", "chip_count": chips})


def _running(*chip_sets: list[int]) -> dict[str, Any]:
    return {
        f"job-{i}": SimpleNamespace(request_dict={h.TPU_CHIPS: chips})
        for i, chips in enumerate(chip_sets)
    }


def test_the_gate_gives_a_tpu_job_the_lowest_free_chips_section_3_3() -> None:
    headers: dict[str, Any] = {}
    assign_chips(headers, 4, _tpu_worker(), _running([0, 1], [4, 5]))
    assert headers[h.TPU_CHIPS] == [2, 3, 6, 7]


def test_concurrent_tpu_jobs_never_share_a_chip_section_3_3() -> None:
    caps, running = _tpu_worker(), dict[str, Any]()
    for i, count in enumerate((4, 2, 8, 2)):
        headers: dict[str, Any] = {}
        assign_chips(headers, count, caps, running)
        running[f"job-{i}"] = SimpleNamespace(request_dict=headers)
    sets = [r.request_dict[h.TPU_CHIPS] for r in running.values()]
    assert sets == [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12, 13], [14, 15]]


def test_a_finished_jobs_chips_are_free_again_once_its_request_is_gone() -> None:
    caps, running = _tpu_worker(4), _running([0, 1], [2, 3])
    del running["job-0"]
    headers: dict[str, Any] = {}
    assign_chips(headers, 2, caps, running)
    assert headers[h.TPU_CHIPS] == [0, 1]


def test_a_job_without_tpu_chips_gets_no_chip_header() -> None:
    headers: dict[str, Any] = {}
    assign_chips(headers, 0, _tpu_worker(), {})
    assert h.TPU_CHIPS not in headers


def test_short_of_free_chips_the_pick_still_has_the_count_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert pick_chips(2, 2, [0]) == [1, 0]
    assert "sharing chips [0]" in caplog.text


@pytest.mark.parametrize(
    ("chips", "bounds"),
    [([0], "1,1,1"), ([2, 3], "1,2,1"), ([4, 5, 6, 7], "2,2,1"), (list(range(8)), "2,4,1")],
)
def test_a_sub_slice_gets_its_chips_bounds_one_process_and_a_port_of_its_own(
    chips: list[int], bounds: str
) -> None:
    port = str(8476 + chips[0])
    assert tpu_env(chips) == {
        "TPU_VISIBLE_CHIPS": ",".join(str(c) for c in chips),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": bounds,
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
        "TPU_PROCESS_PORT": port,
    }


def test_the_jobs_topology_gives_the_bounds_when_it_has_as_many_chips_section_3_3() -> None:
    assert tpu_env([0, 1, 2, 3, 4, 5, 6, 7], "4x2")["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "4,2,1"
    assert tpu_env([0, 1, 2, 3], "2x4")["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"


def test_chip_indices_map_through_the_workers_own_visible_chips() -> None:
    """A worker started on chips 4-7 of the host: allocation index 0 is chip 4."""
    env = tpu_env([0, 1], visible="4,5,6,7")
    assert (env["TPU_VISIBLE_CHIPS"], env["TPU_PROCESS_PORT"]) == ("4,5", str(8476 + 4))
    assert tpu_env([0], visible="9") == tpu_env([9])
    assert tpu_env([5], visible="4,5") == {}  # not one of the worker's chips: no pinning


def _request(chips: list[int] | None, pin: bool = True, **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(**{h.DEVICES: [], h.PIN: pin, h.TPU_CHIPS: chips, **extra})


def test_the_child_selects_the_chips_for_the_task_body_and_clears_them_after() -> None:
    request = _request([2, 3], ext_ml_tpu_topology="1x2")
    pinning.pin_request(request)
    during = {name: os.environ.get(name) for name in NAMES}
    pinning.unpin_request(request)

    assert during == tpu_env([2, 3])
    assert {name: os.environ.get(name) for name in NAMES} == dict.fromkeys(NAMES)


def test_the_child_puts_back_the_workers_own_tpu_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TPU_VISIBLE_CHIPS", "4,5,6,7")
    monkeypatch.setenv("TPU_PROCESS_PORT", "9000")
    request = _request([1])
    pinning.pin_request(request)
    during = (os.environ["TPU_VISIBLE_CHIPS"], os.environ["TPU_PROCESS_PORT"])
    pinning.unpin_request(request)

    assert during == ("5", str(8476 + 5))
    assert (os.environ["TPU_VISIBLE_CHIPS"], os.environ["TPU_PROCESS_PORT"]) == ("4,5,6,7", "9000")
    assert "TPU_PROCESS_BOUNDS" not in os.environ


def test_without_pinning_the_environment_is_left_alone_and_the_task_reads_its_chips() -> None:
    """Under a pool other than prefork the environment is the whole process's."""
    from celery_ojs_ml.child.tpu_env import chips

    request = _request([0, 1], pin=False)
    pinning.pin_request(request)
    assert all(name not in os.environ for name in NAMES)
    assert chips(SimpleNamespace(request=request)) == [0, 1]
    pinning.unpin_request(request)


def test_a_producer_cannot_choose_the_chips_the_gate_drops_the_header() -> None:
    headers: dict[str, Any] = {h.TPU_CHIPS: [0, 1, 2, 3]}
    InboundCheck(DEFAULT_BOUNDS, 65536).requirements(headers)
    assert h.TPU_CHIPS not in headers
