"""The live table: device spans, the final table with its notes, the change lines."""

from __future__ import annotations

import io

import pytest

from celery_ojs_ml.demo.jobs import DemoJob
from celery_ojs_ml.demo.table import LivePrinter, devices_text, render
from celery_ojs_ml.demo.watch import DONE, HELD, QUEUED, WAITING, Row

DEVICES = {
    "contiguous GPUs are one span": ([0, 1, 2, 3], True, "GPU 0-3"),
    "spans are split at gaps": ([7, 6, 0, 1, 3], True, "GPU 0-1,3,6-7"),
    "a job that ran without GPUs ran on CPUs": ([], True, "cpu"),
    "a job that has not run has no devices": ([], False, "-"),
}


@pytest.mark.parametrize("devices,ran,text", list(DEVICES.values()), ids=list(DEVICES))
def test_devices_text(devices: list[int], ran: bool, text: str) -> None:
    assert devices_text(devices, ran=ran) == text


TRAIN = DemoJob("t1", "§12.1 chain 2/4", "ml.train", "reserved", frozenset({"a100@demo"}),
                note="nvidia-h100 -> nvidia-a100")  # fmt: skip
NEVER = DemoJob("t2", "zz-impossible", "ml.train", "on-demand", frozenset())
PLAIN = DemoJob("t3", "§12.1 chain 4/4", "ml.deploy", "on-demand", frozenset({"x"}), routed=False)
ROWS = [
    Row(TRAIN, DONE, node="a100@demo", devices=tuple(range(8)), started=12.0, finished=13.5),
    Row(NEVER, WAITING, reason="0/3 workers eligible: 1 gpu_count 8 < 16"),
    Row(PLAIN, QUEUED),
]


def test_the_final_table_shows_placement_substitutions_and_why_jobs_wait() -> None:
    assert render(ROWS, t0=10.0, width=120) == [
        "job                task       band       node       devices  state    time (s)",
        "-----------------  ---------  ---------  ---------  -------  -------  --------",
        "§12.1 chain 2/4 *  ml.train   reserved   a100@demo  GPU 0-7  done     2.0-3.5",
        "zz-impossible      ml.train   on-demand  -          -        waiting",
        "§12.1 chain 4/4    ml.deploy  plain      -          -        queued",
        "band plain: no hard constraints, so plain Celery routing (any worker, no gate)",
        "* §12.1 chain 2/4: nvidia-h100 -> nvidia-a100 (the demo fleet has no such GPU)",
        "zz-impossible waiting: 0/3 workers eligible: 1 gpu_count 8 < 16",
    ]


def test_off_a_terminal_each_change_is_one_line_and_the_table_comes_at_the_end() -> None:
    out = io.StringIO()
    printer = LivePrinter(out, live=False)
    held = Row(TRAIN, HELD, node="a100@demo", reason="gpu_count free 4 < 8")
    printer.update([held], t0=0.0, now=1.25)
    printer.update([held], t0=0.0, now=1.5)  # unchanged: nothing printed
    printer.update([ROWS[0]], t0=0.0, now=13.5)
    printer.finish([ROWS[0]], t0=10.0)
    lines = out.getvalue().splitlines()
    assert lines[:2] == [
        "[  1.2s] §12.1 chain 2/4              held on a100@demo: gpu_count free 4 < 8",
        "[ 13.5s] §12.1 chain 2/4              done on a100@demo (GPU 0-7)",
    ]
    assert "\x1b" not in out.getvalue()
    assert lines[3].startswith("job ")


def test_on_a_terminal_the_table_is_redrawn_in_place() -> None:
    out = io.StringIO()
    printer = LivePrinter(out, live=True)
    printer.update(ROWS, t0=0.0, now=0.5)
    drawn = out.getvalue().count("\n")
    printer.update([ROWS[0], ROWS[1], Row(PLAIN, DONE, node="cpu@demo")], t0=0.0, now=0.7)
    assert f"\x1b[{drawn}F\x1b[J" in out.getvalue()
    assert out.getvalue().rstrip().endswith("[0.7s]")
