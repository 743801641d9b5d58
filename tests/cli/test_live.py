"""`celery ojs-ml status | explain | submit` against a real prefork worker on a private Redis.

One module-wide fleet: worker `a@test` (2 simulated A100s) runs a long
`ml.record` job on one GPU; an impossible job (8x B200) waits with a pending
record; `ghost@test` is advertised in the store only, so it is alive there but
answers no inspect, and it holds one job. Every verb is run in-process through
click's CliRunner, and `status` also as a real `celery` and `celery-ojs-ml`
subprocess, so both entry points and the `-A` handling are covered.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_ojs_ml.capabilities import capabilities_to_dict, resolve_capabilities
from celery_ojs_ml.cli.main import cli
from celery_ojs_ml.store.deadletter import dead_letter
from celery_ojs_ml.store.registry import OJSStore
from tests.helpers import ROOT
from tests.integration.mlapp import make_app
from tests.integration.workers import WorkerProcess

pytestmark = pytest.mark.integration

APP = "tests.integration.mlapp:app"
BIN = Path(sys.executable).parent
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
IMPOSSIBLE = {"ext_ml_gpu_type": "nvidia-b200", "ext_ml_gpu_count": 8}
HELD_REASON = "gpu_count free 0 < 1"
GPU_COUNT_0 = {"type": "ml.record", "ext_ml_gpu_count": 0, "ext_ml_gpu_type": "nvidia-a100"}
GPU_COUNT_0_ERROR = (
    "ext_ml_gpu_count is 0 but ext_ml_gpu_type is set (OJS ML §3.2); "
    'set ext_ml_gpu_count >= 1, e.g. "ext_ml_gpu_count": 1, or remove ext_ml_gpu_type'
)


@dataclass
class Fleet:
    app: Celery
    store: OJSStore
    redis_url: str
    long_id: str
    device: int
    """The GPU index the long job holds."""
    waiting_id: str


def _advertise_ghost(store: OJSStore) -> None:
    """A worker that is live in the store but answers no inspect, holding one job."""
    held = [
        {"task_id": "held-job-1", "band": "spot", "priority": 0, "since": 0, "reason": HELD_REASON}
    ]
    free = {
        "capacity": {"gpu_count": 0, "cpu_cores": 8, "memory_gb": 32.0, "tpu_chip_count": 0},
        "free": {"gpu_count": 0, "cpu_cores": 8, "memory_gb": 32.0, "tpu_chip_count": 0},
        "devices": {},
        "allocations": [],
        "held": held,
    }
    caps = capabilities_to_dict(resolve_capabilities("profile:cpu"))
    store.advertise("ghost@test", caps, free, ttl_s=600, info={"pinning": False})
    store.set_held("ghost@test", held, ttl_s=600)


def _device_of(store: OJSStore, worker: str, task_id: str, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        devices = store.live_workers().get(worker, {}).get("free", {}).get("devices", {})
        for index, holder in devices.items():
            if holder == task_id:
                return int(index)
        time.sleep(0.1)
    raise AssertionError(f"{task_id} never started on {worker}")


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    store = OJSStore(client, prefix="ojs")
    worker = WorkerProcess(
        "a", redis_url, "profile:nvidia-a100x2", tmp_path_factory.mktemp("live"), concurrency=3
    )
    app = make_app(redis_url)
    try:
        worker.start().wait_live(store)
        _advertise_ghost(store)
        long_job = app.tasks["ml.record"].apply_async(args=["long", 120])
        waiting = app.tasks["ml.record"].apply_async(args=["never"], headers=dict(IMPOSSIBLE))
        device = _device_of(store, "a@test", long_job.id)
        yield Fleet(app, store, redis_url, long_job.id, device, waiting.id)
    finally:
        worker.stop(signal.SIGQUIT)  # cold shutdown: do not wait for the 120 s job
        app.close()
        client.flushall()
        client.close()


def invoke(fleet: Fleet, *args: str | Path) -> Result:
    """Run the `ojs-ml` group as `celery -A app ojs-ml ...` would, with the app in ctx.obj."""
    obj = CLIContext(app=fleet.app, no_color=True, workdir=None, quiet=False)
    return CliRunner().invoke(cli, [str(a) for a in args], obj=obj, catch_exceptions=False)


def write(tmp_path: Path, name: str, doc: Any) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def _run(
    *argv: str, fleet: Fleet, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OJS_TEST_BROKER": fleet.redis_url, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


# status


def assert_status_text(out: str, fleet: Fleet) -> None:
    """What a user must be able to read off `status`: GPUs, holders, waiting jobs and why."""
    lines = out.splitlines()
    assert "a@test  answering  2x nvidia-a100" in lines
    assert f"  gpu {fleet.device}     {fleet.long_id} (band on-demand)" in lines
    assert f"  gpu {1 - fleet.device}     free" in lines
    assert "  free      gpu_count 1/2, cpu_cores 24/24, memory_gb 256/256" in lines
    assert f"  {fleet.waiting_id}  ml.record, queue celery, band on-demand, waiting" in out
    reason = out.split(fleet.waiting_id, 1)[1]
    assert "reason  0/2 workers eligible:" in reason
    assert "gpu_type nvidia-a100 not in [nvidia-b200]" in " ".join(reason.split())


def test_status_shows_gpu_types_which_task_holds_which_device_and_why_jobs_wait(
    fleet: Fleet,
) -> None:
    result = invoke(fleet, "status")
    assert result.exit_code == 0, result.output
    assert_status_text(result.stdout, fleet)


def test_status_shows_a_worker_live_in_the_store_but_not_answering_and_its_held_job(
    fleet: Fleet,
) -> None:
    out = invoke(fleet, "status").stdout
    assert re.search(
        r"^ghost@test  not answering \(last heartbeat [\d.]+ s ago; state from the store\)  cpu$",
        out,
        re.M,
    ), out
    assert f"  held      held-job-1 (band spot): {HELD_REASON}" in out.splitlines()
    assert "  held      none" in out.split("ghost@test")[0], "a@test holds nothing"


def test_status_json_has_the_same_facts_for_scripts(fleet: Fleet) -> None:
    result = invoke(fleet, "status", "--json", "--timeout", "0.5")
    report = json.loads(result.stdout)
    a = report["workers"]["a@test"]
    assert (a["state"], a["labels"]["gpu_type"], a["pinning"]) == ("answering", "nvidia-a100", True)
    assert a["processes"] == 3, "its pool's processes (-c 3), as the fleet scheduler counts them"
    assert report["workers"]["ghost@test"]["processes"] is None, "not in its heartbeat"
    assert a["plain_running"] == 0, "only an ML job runs there (it is not a plain task)"
    assert a["devices"] == {str(fleet.device): fleet.long_id, str(1 - fleet.device): None}
    assert [x["task_id"] for x in a["allocations"]] == [fleet.long_id]
    assert report["workers"]["ghost@test"]["state"] == "not answering"
    assert report["workers"]["ghost@test"]["held"][0]["reason"] == HELD_REASON
    waiting = report["pending"][fleet.waiting_id]
    assert (waiting["task"], waiting["band"]) == ("ml.record", "on-demand")
    assert waiting["reason"].startswith("0/2 workers eligible: ")


def test_status_runs_as_a_real_celery_subcommand_with_the_app_from_celery_dash_a(
    fleet: Fleet,
) -> None:
    proc = _run(sys.executable, "-m", "celery", "-A", APP, "ojs-ml", "status", fleet=fleet)
    assert proc.returncode == 0, proc.stderr
    assert_status_text(proc.stdout, fleet)


CONSOLE = {
    "with its own -A option": (("-A", APP), {}),
    "from $CELERY_APP": ((), {"CELERY_APP": APP}),
}


@pytest.mark.parametrize("case", list(CONSOLE.values()), ids=list(CONSOLE))
def test_the_console_script_takes_the_app_from_dash_a_or_celery_app(
    fleet: Fleet, case: tuple[tuple[str, ...], dict[str, str]]
) -> None:
    app_args, env = case
    proc = _run(str(BIN / "celery-ojs-ml"), "status", *app_args, "--json", fleet=fleet, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["workers"]["a@test"]["devices"][str(fleet.device)] == fleet.long_id


INSPECT: dict[str, tuple[str, ...]] = {
    "with the app": ("-A", APP, "inspect", "ojs_ml_capabilities"),
    "without the app, known through the celery.commands entry point": (
        "inspect",
        "ojs_ml_allocations",
    ),
}


@pytest.mark.parametrize("args", list(INSPECT.values()), ids=list(INSPECT))
def test_celery_inspect_knows_the_ojs_ml_commands(fleet: Fleet, args: tuple[str, ...]) -> None:
    broker = () if "-A" in args else ("-b", fleet.redis_url)
    proc = _run(sys.executable, "-m", "celery", *broker, *args, "--json", fleet=fleet)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reply = json.loads(proc.stdout)["a@test"]
    if "labels" in reply:
        assert reply["labels"]["gpu_type"] == "nvidia-a100"
    else:
        assert reply["devices"][str(fleet.device)] == fleet.long_id


# explain


EXPLAIN_TASK = {
    "a running task says where and on which GPU": (
        lambda f: f.long_id,
        lambda f: f"{f.long_id} runs on a@test with GPU(s) {f.device} (band on-demand)",
        0,
    ),
    "a held task says where and why": (
        lambda f: "held-job-1",
        lambda f: f"held-job-1 is held on ghost@test (band spot): {HELD_REASON}",
        0,
    ),
    "an unknown task id exits 1": (
        lambda f: "no-such-task",
        lambda f: "no-such-task is unknown: no pending record, and no answering ojs-ml worker",
        1,
    ),
}


@pytest.mark.parametrize("case", list(EXPLAIN_TASK.values()), ids=list(EXPLAIN_TASK))
def test_explain_a_task_id(fleet: Fleet, case: Any) -> None:
    task_id, expected, code = case
    result = invoke(fleet, "explain", task_id(fleet), "--timeout", "0.5")
    assert result.exit_code == code
    assert result.stdout.startswith(expected(fleet)), result.stdout


def test_explain_a_waiting_task_prints_its_pending_reason(fleet: Fleet) -> None:
    result = invoke(fleet, "explain", fleet.waiting_id, "--timeout", "0.5")
    assert result.exit_code == 0
    head, reason = result.stdout.splitlines()
    assert head.startswith(f"{fleet.waiting_id} waits (ml.record, queue celery, band on-demand, ")
    assert reason == "    " + fleet.store.pending()[fleet.waiting_id]["reason"]


def test_explain_a_scheduled_task_gives_the_schedulers_reason_and_reservation(
    fleet: Fleet,
) -> None:
    """The job fits `a@test` only once the long job ends: it waits in the pending set,
    first in fleet order, with the leader's RFC 27 annotation (reason and reserved worker)."""
    queued = fleet.app.tasks["ml.record"].apply_async(
        args=["queued"], headers={"ext_ml_gpu_count": 2}
    )
    try:
        deadline = time.monotonic() + 15
        data: dict[str, Any] = {}
        while time.monotonic() < deadline:  # until the leader's pass annotates it
            data = json.loads(invoke(fleet, "explain", queued.id, "--json").stdout)
            if data.get("worker"):
                break
            time.sleep(0.2)
        assert data["state"] == "pending", data
        assert data["worker"] == "a@test", data
        assert "gpu_count" in data["reason_pending"], data
        result = invoke(fleet, "explain", queued.id, "--timeout", "0.5")
        assert result.exit_code == 0, result.stdout
        head, why = result.stdout.splitlines()
        facts = "(ml.record, queue celery, band on-demand, "
        assert head.startswith(f"{queued.id} waits {facts}"), head
        assert why == "    " + data["reason_pending"], why
    finally:
        assert fleet.app.ojs_ml.cancel(queued.id), "a job no worker started can be cancelled"


def test_explain_a_file_gives_each_live_workers_verdict_with_live_free_capacity(
    fleet: Fleet, tmp_path: Path
) -> None:
    job = write(tmp_path, "two.json", {"type": "ml.record", "ext_ml_gpu_count": 2})
    result = invoke(fleet, "explain", job)
    assert result.exit_code == 0
    a, ghost, message = result.stdout.splitlines()
    assert re.fullmatch(r"a@test +WAIT  score 100  gpu_count free [01] < 2", a), a
    assert ghost.startswith("ghost@test               NEVER score 0  accelerator cpu != gpu")
    assert message.startswith("1/2 workers eligible: ")


def test_explain_a_file_no_live_worker_can_run_prints_the_pending_message_and_exits_1(
    fleet: Fleet, tmp_path: Path
) -> None:
    job = write(tmp_path, "b200.json", {"type": "ml.record", **IMPOSSIBLE})
    result = invoke(fleet, "explain", job, "--json")
    assert result.exit_code == 1
    body = json.loads(result.stdout)
    assert [(w["worker"], w["verdict"]) for w in body["workers"]] == [
        ("a@test", "NEVER"),
        ("ghost@test", "NEVER"),
    ]
    assert body["pending_message"].startswith("0/2 workers eligible: ")
    assert "gpu_type nvidia-a100 not in [nvidia-b200]" in body["pending_message"]


def test_explain_an_invalid_file_exits_1_naming_the_attribute(fleet: Fleet, tmp_path: Path) -> None:
    job = write(tmp_path, "bad.json", GPU_COUNT_0)
    result = invoke(fleet, "explain", job)
    assert result.exit_code == 1
    assert result.stderr == f"{job}: {GPU_COUNT_0_ERROR}\n"


def test_explain_a_missing_file_exits_2(fleet: Fleet, tmp_path: Path) -> None:
    result = invoke(fleet, "explain", tmp_path / "missing.json")
    assert result.exit_code == 2
    assert "cannot read" in result.stderr


# submit


def test_submit_prints_the_task_id_and_with_wait_the_result(fleet: Fleet, tmp_path: Path) -> None:
    job = write(tmp_path, "job.json", {"type": "ml.record", "args": ["sub"], "ext_ml_gpu_count": 1})
    result = invoke(fleet, "submit", job, "--wait", "--wait-timeout", "60", "--json")
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.stdout)
    assert UUID.match(row["task_id"])
    assert row["state"] == "SUCCESS"
    assert (row["result"]["tag"], row["result"]["worker"]) == ("sub", "a@test")
    assert row["result"]["devices"] == [1 - fleet.device], "the GPU the long job does not hold"


def test_submit_of_a_group_prints_each_task_id(fleet: Fleet, tmp_path: Path) -> None:
    jobs = [{"type": "ml.record", "args": [f"g{i}"], "ext_ml_gpu_count": 1} for i in range(2)]
    doc = write(tmp_path, "group.json", {"workflow_type": "group", "jobs": jobs})
    result = invoke(fleet, "submit", doc)
    assert result.exit_code == 0, result.output
    ids = result.stdout.split()
    assert len(ids) == 2 and all(UUID.match(i) for i in ids)
    tags = [fleet.app.AsyncResult(i).get(timeout=60)["tag"] for i in ids]
    assert tags == ["g0", "g1"]


def test_submit_of_a_chain_prints_its_task_ids_in_order(fleet: Fleet, tmp_path: Path) -> None:
    steps = [
        {"type": "plain.add", "args": [1, 2]},
        {"type": "ml.record", "args": [], "ext_ml_gpu_count": 1},  # gets the sum as its tag
    ]
    doc = write(tmp_path, "chain.json", {"workflow_type": "chain", "steps": steps})
    result = invoke(fleet, "submit", doc, "--wait", "--wait-timeout", "60", "--json")
    assert result.exit_code == 0, result.output
    first, second = json.loads(result.stdout)
    assert (first["state"], second["state"]) == ("SUCCESS", "SUCCESS")
    assert first["result"]["sum"] == 3
    assert second["result"]["tag"] == first["result"], "the second id is the second step"


def test_submit_of_an_invalid_file_exits_1_naming_the_attribute(
    fleet: Fleet, tmp_path: Path
) -> None:
    job = write(tmp_path, "bad.json", GPU_COUNT_0)
    result = invoke(fleet, "submit", job)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == f"{job}: {GPU_COUNT_0_ERROR}\n"


def test_submit_of_an_unreadable_file_exits_2(fleet: Fleet, tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{bad", encoding="utf-8")
    result = invoke(fleet, "submit", path)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {path} is neither valid JSON nor YAML")


def test_explain_a_dead_lettered_task_gives_its_reason_and_how_to_retry(fleet: Fleet) -> None:
    reason = "denied: no live worker could run it for 300 s (RFC 27 deny)"
    dead_letter(fleet.store, {"task_id": "dead-job-1", "name": "ml.record"}, reason)
    result = invoke(fleet, "explain", "dead-job-1", "--timeout", "0.5")
    assert result.exit_code == 0, result.stdout
    assert result.stdout.strip() == (
        f"dead-job-1 was dead-lettered: {reason}; `celery ojs-ml dead --retry dead-job-1` "
        "re-publishes it, from the start (no checkpoint)"
    )
    shown = json.loads(invoke(fleet, "explain", "dead-job-1", "--json").stdout)
    assert (shown["state"], shown["reason"]) == ("dead", reason)
