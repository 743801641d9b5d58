"""Every runnable example in examples/ runs end to end against real workers.

Each test starts the workers that the example's docstring says to start (its
`celery -A examples.<name> worker ...` lines, with simulated GPUs), runs the
documented `python -m examples.<name>` in a subprocess against the test
redis-server (`OJS_EXAMPLE_BROKER`), and checks what really happened, from the
example's output and the workers' logs.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.helpers import ROOT
from tests.integration.workers import WorkerProcess, running

pytestmark = pytest.mark.integration
_RUN_TIMEOUT_S = 90
_COMMAND = re.compile(r"^(export [A-Z_]+=|([A-Z_]+=\S+ )*(celery|python) )")
"""A command line in a docstring: `[export] [VAR=value ...] celery|python ...`."""


@dataclass
class _Documented:
    """The commands in an example's docstring."""

    env: dict[str, str]
    """Set by `export VAR=value ...` lines, for every command."""
    workers: list[list[str]]
    """`[VAR=value ...] celery -A examples.<name> worker ...` lines."""
    run: list[str]
    """The `python -m examples.<name> ...` line."""


def _documented(example: str) -> _Documented:
    doc = importlib.import_module(f"examples.{example}").__doc__ or ""
    found = _Documented({}, [], [])
    for line in doc.splitlines():
        if not _COMMAND.match(line.strip()):
            continue
        words = shlex.split(line, comments=True)
        if words[0] == "export":
            found.env.update(w.split("=", 1) for w in words[1:])
        elif words[:3] == ["python", "-m", f"examples.{example}"]:
            found.run = words
        elif f"-A examples.{example} worker" in line:
            found.workers.append(words)
    assert found.workers and found.run, f"examples/{example}.py documents no worker or run command"
    return found


def _worker(argv: list[str], index: int, env: dict[str, str], logdir: Path) -> WorkerProcess:
    """A WorkerProcess running a documented command line, named by its `-n` (or `w<index>`),
    logging at INFO, without the start-up chatter of mingle and gossip."""
    at = argv.index("celery")
    assigned = dict(a.split("=", 1) for a in argv[:at])
    args = argv[at + 1 :]
    name = f"w{index}"
    if "-n" in args:
        name = args[args.index("-n") + 1].split("@")[0]
        del args[args.index("-n") : args.index("-n") + 2]
    worker = WorkerProcess(name, env["OJS_EXAMPLE_BROKER"], "(documented)", logdir)
    worker.argv = [sys.executable, "-m", "celery", *args, "-n", worker.hostname, "-l", "INFO",
                   "--without-mingle", "--without-gossip"]  # fmt: skip
    worker.env = {**env, **assigned}
    return worker


def _run_example(
    example: str, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> tuple[str, list[WorkerProcess]]:
    """Start the documented workers, run the documented `python -m examples.<name>` against
    them, stop them; the example's stdout and the (stopped) workers, for their logs.

    The commands get the test broker, a private checkpoint directory and what the
    docstring exports."""
    documented = _documented(example)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OJS_EXAMPLE_BROKER": redis_url,
        "OJS_EXAMPLE_CKPT": f"file://{tmp_path}/ckpt/",
        **documented.env,
    }
    workers = [_worker(a, i, env, tmp_path) for i, a in enumerate(documented.workers)]
    with running(workers, OJSStore(redis_client, prefix="ojs")):
        proc = subprocess.run(
            [sys.executable, *documented.run[1:]],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=_RUN_TIMEOUT_S,
            check=False,
        )
    assert proc.returncode == 0, f"examples/{example}.py failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout, workers


def test_spot_training_is_preempted_by_a_reserved_job_and_resumes_after_its_last_checkpoint(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """OJS ML §8.2 and §9.3: the resumed run starts right after the last committed step."""
    out, [worker] = _run_example("spot_training", redis_url, redis_client, tmp_path)
    log = worker.output()
    before, _, after = log.partition("re-published (preemption 1)")
    assert after, f"train was never preempted:\n{out}\n{log[-3000:]}"
    last_step = int(re.findall(r"committed checkpoint \d+ \(.*?step (\d+)", before)[-1])
    resumed = re.search(r"resumes from checkpoint \d+ \(.*?step (\d+)\)", after)
    assert resumed and int(resumed.group(1)) == last_step, "resumed from another checkpoint"
    assert f"preempted 1 time(s), resumed at step {last_step + 1}, finished 20 steps" in out
    assert "urgent job ran on GPU [0]" in out
    assert "(w=10.0)" in out, "the resumed run did not continue from the checkpointed state"


def test_the_inference_app_loads_its_model_once_per_pool_child_and_deduplicates_a_request(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    out, _ = _run_example("inference_app", redis_url, redis_client, tmp_path)
    assert len(re.findall(r"^'[a-z ]+': pool child \d+, embedding \[", out, re.M)) == 3, out
    assert "'a photo of a cat' again within 10 s: answered by the first request's job" in out
    loads = re.search(r"model loads per pool child: \{(.*)\}", out)
    assert loads is not None, out
    per_child = [int(n) for n in re.findall(r"\d+: (\d+)", loads.group(1))]
    assert per_child and all(n == 1 for n in per_child), f"a loader ran twice in a child: {out}"


def test_gang_training_runs_both_ranks_at_once_on_distinct_workers(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Flux RFC 25 node>slot: one rank per worker, and the all-reduce of 1 + 2 is 3 on each."""
    pytest.importorskip("torch")
    out, _ = _run_example("gang_training", redis_url, redis_client, tmp_path)
    ranks = re.findall(r"^rank (\d) on (\w+)@test: 5 epochs, sum 3.0$", out, re.M)
    assert sorted(r for r, _ in ranks) == ["0", "1"], out
    assert {w for _, w in ranks} == {"a", "b"}, f"two ranks on one worker: {out}"


def test_the_reservation_pipeline_trains_inside_its_reservation_and_an_outside_job_waits(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """OJS ML §8.3: prepare, then train on the held GPUs; nothing outside uses them meanwhile."""
    out, _ = _run_example("reservation_pipeline", redis_url, redis_client, tmp_path)
    lines = out.splitlines()
    rid = lines[0].removeprefix("reserved 8 GPUs: ")
    assert lines[1:4] == [
        "prepare -> s3://bucket/corpus.prepared",
        "train inside the reservation on GPUs [0, 1, 2, 3, 4, 5, 6, 7] <- s3://bucket/corpus.prepared",
        f"released {rid}",
    ], out
    waited = re.fullmatch(
        r"the 8-GPU job outside the reservation started (-?[\d.]+) s after train ended", lines[4]
    )
    assert waited is not None and float(waited.group(1)) >= 0, out


def test_the_spot_sweep_escalates_its_trials_past_the_on_demand_stream_and_finishes_them(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """OJS ML §8.4: a waiting spot trial escalates to on-demand and runs before the stream ends."""
    out, [worker] = _run_example("spot_sweep", redis_url, redis_client, tmp_path)
    jobs = re.findall(r"^\+ *[\d.]+ s  (.+)$", out, re.M)
    trials = [i for i, job in enumerate(jobs) if job.startswith("trial ")]
    assert len(trials) == 3 and len(jobs) == 11, out
    assert trials[-1] < jobs.index("on-demand 7"), f"a trial waited for the whole stream: {out}"
    assert "all 3 trials done; best: trial lr=0.01 (loss 0.10)" in out
    assert "escalated from spot to on-demand (OJS ML §8.4)" in worker.output()


def test_the_pipeline_deploys_a_good_model_and_stops_a_bad_one_before_deploy_with_the_reason(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """OJS ML Extensions §5.4: a missed threshold stops the chain before deployment."""
    out, [worker] = _run_example("train_evaluate_deploy", redis_url, redis_client, tmp_path)
    good, bad = out.splitlines()
    assert good == "run-good: deployed s3://models/run-good/ with {'accuracy': 0.95, 'loss': 0.05}"
    assert bad == (
        "run-bad: not deployed: evaluation thresholds not met (OJS ML Extensions §5.4): "
        "accuracy 0.71 < min 0.9; loss 0.29 > max 0.2"
    )
    deployed = re.findall(
        r"Task examples\.train_evaluate_deploy\.deploy\[.*\] succeeded", worker.output()
    )
    assert len(deployed) == 1, "deploy ran for the bad model"
