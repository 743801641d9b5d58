"""The fleet view without a broker: rendering of a status report, task location, usage errors.

The report is built by hand in the shape `gather()` returns, so these tests pin
the text users read (byte for byte) and the exit-2 paths that need no fleet.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from celery import Celery
from click.testing import CliRunner

from celery_ojs_ml import OJSML
from celery_ojs_ml.cli.fleet import locate, render_location, render_status
from celery_ojs_ml.cli.live import task_ids
from celery_ojs_ml.cli.main import cli

NOW = 1000.0
LABELS = {"accelerator": "gpu", "gpu_type": "nvidia-l4", "gpu_count": "2"}


def _worker(**over: Any) -> dict[str, Any]:
    view = {
        "state": "answering",
        "capabilities": {},
        "labels": LABELS,
        "capacity": {"gpu_count": 2, "cpu_cores": 8, "memory_gb": 32.0, "tpu_chip_count": 0},
        "free": {"gpu_count": 1, "cpu_cores": 8, "memory_gb": 32.0, "tpu_chip_count": 0},
        "devices": {"0": "t-run", "1": None},
        "allocations": [{"task_id": "t-run", "devices": [0], "band": "reserved"}],
        "held": [{"task_id": "t-held", "band": "spot", "reason": "gpu_count free 1 < 2"}],
        "queues": ["celery.ml.abc.spot"],
        "pinning": True,
    }
    return {**view, **over}


REPORT: dict[str, Any] = {
    "workers": {
        "w1@h": _worker(),
        "w2@h": _worker(state="not answering", heartbeat_age_s=2.5, held=[], queues=[]),
        "plain@h": {"state": "no ojs-ml gate", "error": "no ojs-ml gate"},
    },
    "pending": {
        "t-wait": {
            "reason": "0/2 workers eligible: 2 gpu_type nvidia-l4 not in [nvidia-b200]",
            "task": "ml.train",
            "queue": "celery",
            "band": "on-demand",
            "since": NOW - 42.4,
        }
    },
    "scheduler": {
        "leader": {"id": "w1@h", "since": NOW - 30.0},
        "jobs": {
            "t-big": {
                "state": "pending",
                "reason_pending": "reserved: 4 gpu_count free on w1@h at the estimated time",
                "t_estimate": NOW + 12.3,
                "worker": "w1@h",
                "task": "ml.train",
                "queue": "celery",
                "band": "on-demand",
                "priority": 0,
                "since": NOW - 5.0,
            },
            "t-go": {
                "state": "assigned",
                "reason_pending": None,
                "t_estimate": None,
                "worker": "w2@h",
                "task": "ml.infer",
                "queue": "celery",
                "band": "spot",
                "priority": 0,
                "since": NOW - 1.0,
            },
        },
    },
    "errors": [],
    "time": NOW,
}

EXPECTED_STATUS = """\
w1@h  answering  2x nvidia-l4
  labels    accelerator=gpu gpu_type=nvidia-l4 gpu_count=2
  free      gpu_count 1/2, cpu_cores 8/8, memory_gb 32/32
  pinning   CUDA_VISIBLE_DEVICES per task
  gpu 0     t-run (band reserved)
  gpu 1     free
  held      t-held (band spot): gpu_count free 1 < 2
  reserved  t-big (starts in ~12 s)
  queues    celery.ml.abc.spot

w2@h  not answering (last heartbeat 2.5 s ago; state from the store)  2x nvidia-l4
  labels    accelerator=gpu gpu_type=nvidia-l4 gpu_count=2
  free      gpu_count 1/2, cpu_cores 8/8, memory_gb 32/32
  pinning   CUDA_VISIBLE_DEVICES per task
  gpu 0     t-run (band reserved)
  gpu 1     free
  held      none

plain@h  no ojs-ml gate: no ojs-ml gate

scheduler: w1@h leads (for 30 s)
scheduled jobs: 2
  t-big  ml.train, band on-demand, starts in ~12 s, reserved on w1@h
      reason: reserved: 4 gpu_count free on w1@h at the estimated time
  t-go  assigned to w2@h (ml.infer)

waiting jobs: 1
  t-wait  ml.train, queue celery, band on-demand, waiting 42 s
    reason  0/2 workers eligible: 2 gpu_type nvidia-l4 not in [nvidia-b200]"""


def test_status_renders_workers_devices_held_and_waiting_jobs_exactly() -> None:
    assert render_status(REPORT) == EXPECTED_STATUS


def test_an_empty_fleet_says_so_and_store_errors_are_warnings() -> None:
    report = {"workers": {}, "pending": {}, "errors": ["store unavailable: boom"], "time": NOW}
    assert render_status(report) == (
        "no ojs-ml workers: none answered inspect and the store lists none live\n\n"
        "waiting jobs: none\n\n"
        "warning: store unavailable: boom"
    )


LOCATIONS = {
    "t-wait": "t-wait waits (ml.train, queue celery, band on-demand, waiting 42 s):\n"
    "    0/2 workers eligible: 2 gpu_type nvidia-l4 not in [nvidia-b200]",
    "t-run": "t-run runs on w1@h with GPU(s) 0 (band reserved)",
    "t-held": "t-held is held on w1@h (band spot): gpu_count free 1 < 2",
}


def test_a_task_is_located_as_waiting_running_or_held() -> None:
    for task_id, text in LOCATIONS.items():
        assert render_location(locate(task_id, REPORT), NOW) == text
    assert locate("nope", REPORT) == {"task_id": "nope", "state": "unknown"}


def test_a_live_verb_without_an_ojs_ml_app_is_a_usage_error() -> None:
    result = CliRunner().invoke(
        cli, ["status"], obj=SimpleNamespace(app=Celery("bare", set_as_current=False))
    )
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (
        "Error: this verb needs a Celery app with the OJSML plugin; pass it with -A, "
        "e.g. `celery -A proj ojs-ml status` or `celery-ojs-ml status -A proj`"
    )


def test_an_app_that_cannot_be_imported_is_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["status", "-A", "no_such_module_xyz:app"])
    assert result.exit_code == 2
    assert "cannot load the app 'no_such_module_xyz:app'" in result.stderr


def test_explain_needs_a_target_or_both_offline_options() -> None:
    runner = CliRunner()
    assert runner.invoke(cli, ["explain"]).exit_code == 2
    mixed = runner.invoke(cli, ["explain", "abc", "--job", "j.json", "--workers", "w"])
    assert mixed.exit_code == 2
    assert "offline explain takes --job FILE --workers PATH" in mixed.stderr


def test_submit_wait_without_a_result_backend_is_a_usage_error(tmp_path: Any) -> None:
    app = Celery("no-backend", broker="memory://", set_as_current=False)
    OJSML(app)
    job = tmp_path / "job.json"
    job.write_text('{"type": "ml.x"}', encoding="utf-8")
    result = CliRunner().invoke(cli, ["submit", str(job), "--wait"], obj=SimpleNamespace(app=app))
    assert result.exit_code == 2
    assert "--wait needs a result backend" in result.stderr


def test_task_ids_of_a_chain_are_in_step_order() -> None:
    from celery.result import AsyncResult, GroupResult

    app = Celery("ids", set_as_current=False)
    first = AsyncResult("1", app=app)
    last = AsyncResult("2", app=app, parent=first)
    group = GroupResult("g", [AsyncResult("a", app=app), AsyncResult("b", app=app)], app=app)
    assert (task_ids(last), task_ids(group)) == (["1", "2"], ["a", "b"])


def test_status_shows_jobs_published_but_not_admitted_and_says_when_no_leader_admits_them() -> None:
    from celery_ojs_ml.cli import sched

    part = {"leader": None, "jobs": {}, "intake": {"waiting": 3, "taken": 1}}
    assert sched.render(part, NOW).splitlines()[:2] == [
        "scheduler: no leader (start a worker, or `celery -A proj ojs-ml scheduler`)",
        "intake: 3 published, not yet admitted; 1 taken by a leader, admitted first by the "
        "next one (they wait for a leader)",
    ]
    leading = {"leader": {"id": "w1@h", "since": NOW - 30}, "intake": {"waiting": 2, "taken": 0}}
    assert "intake: 2 published, not yet admitted" in sched.render(leading, NOW).splitlines()
    empty = {"leader": None, "jobs": {}, "intake": {"waiting": 0, "taken": 0}}
    assert not any(line.startswith("intake") for line in sched.render(empty, NOW).splitlines())


def test_status_shows_the_pools_free_processes_and_the_jobs_waiting_for_one() -> None:
    """The fleet scheduler's count (docs/scheduling.md "Pool processes"): the pool's
    processes less the ML jobs allocated there; jobs beyond them wait in the pool."""
    job = {"task_id": "t", "devices": [0], "band": "spot"}

    def lines(**over: Any) -> list[str]:
        report = {"workers": {"w@h": _worker(**over)}, "pending": {}, "errors": [], "time": NOW}
        return [x for x in render_status(report).splitlines() if x.startswith("  processes")]

    assert lines(processes=4, allocations=[job]) == ["  processes 3/4 free"]
    assert lines(processes=1, allocations=[job] * 3) == [
        "  processes 0/1 free, 2 job(s) waiting in the pool for a process"
    ]
    assert lines() == [] and lines(processes=None) == [] and lines(processes=True) == []
    # Plain Celery tasks running in the pool hold processes too.
    assert lines(processes=4, allocations=[job], plain_running=2) == [
        "  processes 1/4 free (2 plain task(s) running)"
    ]
    assert lines(processes=1, allocations=[job], plain_running=1) == [
        "  processes 0/1 free (1 plain task(s) running), 1 job(s) waiting in the pool for a process"
    ]
    assert lines(processes=4, allocations=[job], plain_running="2") == ["  processes 3/4 free"]
