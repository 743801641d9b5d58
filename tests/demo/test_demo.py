"""The demo end to end: `python -m celery_ojs_ml demo`, embedded and against Redis.

Each run is a subprocess, as a user runs it, and writes `--report`; the
assertions come from the hand-written oracle (`oracle.py`), not from the
demo's own verdict alone.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from celery_ojs_ml.cli.main import cli
from celery_ojs_ml.store.registry import OJSStore
from tests.demo.oracle import check_report
from tests.helpers import ROOT, free_port


def _demo(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "celery_ojs_ml", "demo", "--no-live", "--report", str(report)]
    done = subprocess.run(
        [*argv, *args], capture_output=True, text=True, cwd=ROOT, timeout=110, check=False
    )
    assert report.exists(), done.stdout + done.stderr
    return done, json.loads(report.read_text())


def test_the_embedded_demo_runs_every_runnable_job_where_it_may_and_explains_the_rest(
    tmp_path: Path,
) -> None:
    done, report = _demo(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    jobs = check_report(report)
    lines = done.stdout.splitlines()
    assert lines[-1] == "OK"
    assert "* §12.1 chain 2/4: nvidia-h100 -> nvidia-a100 (the demo fleet has no such GPU)" in lines
    why = next(line for line in lines if line.startswith("zz-impossible-16x-b200 waiting: "))
    assert why.startswith("zz-impossible-16x-b200 waiting: 0/3 workers eligible: ")
    assert jobs["§12.1 chain 2/4"]["devices"] == list(range(8))
    assert any(re.fullmatch(r"Scheduler: \w+@demo leads .*", line) for line in lines), lines
    # the A100 node cannot start every job at once: at least one waits with the scheduler's
    # reason and start estimate, then runs
    assert report["waited_with_estimate"], report
    for label in report["waited_with_estimate"]:
        assert jobs[label]["state"] == "done"
        assert any(
            line.endswith("from time limits)") and label in line and "waiting: " in line
            for line in lines
        ), label
    # threads pool: no process-wide CUDA_VISIBLE_DEVICES, the devices come from the request
    assert all(j["cuda_visible_devices"] is None for j in jobs.values())


def _demo_workers_on(url: str) -> list[int]:
    """Pids of live processes started with OJS_DEMO_BROKER=url (Linux /proc)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"OJS_DEMO_BROKER={url}".encode() in environ:
            found.append(int(proc.name))
    return found


@pytest.mark.integration
def test_the_redis_demo_pins_devices_in_real_workers_and_leaves_nothing_behind(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    done, report = _demo(tmp_path, "--broker", redis_url)
    assert done.returncode == 0, done.stdout + done.stderr
    jobs = check_report(report)
    for job in jobs.values():
        if job["state"] == "done" and job["devices"]:  # prefork: pinned per task
            assert job["cuda_visible_devices"] == ",".join(map(str, job["devices"])), job
    store = OJSStore(redis_client, prefix="ojs")
    assert store.live_workers() == {}
    assert store.pending() == {}
    queues = [k for k in redis_client.keys("*.ml.*") if not k.startswith(b"_kombu.")]
    assert queues == []
    if Path("/proc").is_dir():
        assert _demo_workers_on(redis_url) == []


CLI_ERRORS = {
    "an AMQP broker is refused with the forms it takes": (
        ["--broker", "amqp://guest@localhost//"],
        "demo: --broker must be memory:// or redis://HOST:PORT/DB, not 'amqp://guest@localhost//'",
    ),
    "external workers need Redis": (
        ["--external-workers"],
        "demo: --external-workers needs a Redis broker, e.g. --broker redis://...",
    ),
}


@pytest.mark.parametrize("args,message", list(CLI_ERRORS.values()), ids=list(CLI_ERRORS))
def test_a_demo_that_cannot_run_exits_2_and_says_why(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["demo", *args])
    assert result.exit_code == 2
    assert result.stderr.strip() == message


def test_an_unreachable_redis_exits_2_and_names_it() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = CliRunner().invoke(cli, ["demo", "--broker", url])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"demo: cannot reach Redis at {url}; start it or pass another --broker"
    )


def test_demo_workers_consume_every_queue_the_example_jobs_name() -> None:
    """A worker takes ML jobs of its own queues only; the demo app's `task_queues` list them."""
    from celery_ojs_ml.demo.app import QUEUES, make_app
    from celery_ojs_ml.demo.session import prepare

    named = {
        str(job.get("queue"))
        for sub in prepare()
        for job in (sub.doc.get("jobs") or sub.doc.get("steps") or [sub.doc])
        if isinstance(job, dict) and job.get("queue")
    }
    assert len(named) >= 3 and named <= set(QUEUES), (named, set(QUEUES))
    app = make_app("memory://")
    assert {q.name for q in app.conf.task_queues} == set(QUEUES)
