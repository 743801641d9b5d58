"""The demo against Redis: real `celery worker -P prefork` processes, one per node.

`celery-ojs-ml demo --broker redis://HOST:PORT/DB` starts one demo worker per node
(`worker_argv`), with that Redis as broker, result backend and store, runs one
session, and stops them. With `--external-workers` someone else runs the workers
(docker-compose) and the demo only waits for them to advertise.

Key decisions:
* Workers are stopped by pid with SIGTERM (Celery's warm shutdown), then SIGKILL
  after a grace period (`stop`); their logs go to a temporary directory.
* A demo that started the fleet removes what it leaves behind (`discard_waiting`),
  so repeated runs do not pile up unrunnable jobs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from celery_ojs_ml.demo import session
from celery_ojs_ml.demo.app import BROKER_ENV, make_app
from celery_ojs_ml.demo.jobs import EXAMPLES, FLEET, fleet_capabilities
from celery_ojs_ml.demo.table import LivePrinter
from celery_ojs_ml.demo.watch import WAITING, Row
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.wire.queues import PRIORITY_SUFFIXES, queue_name

APP_MODULE = "celery_ojs_ml.demo.app"
CONCURRENCY = {"a100@demo": 4, "l4@demo": 2, "cpu@demo": 2}
_STOP_GRACE_S = 15.0


def worker_argv(
    host: str, capabilities: str, concurrency: int, loglevel: str = "WARNING"
) -> list[str]:
    """The command line of one demo worker."""
    return [
        sys.executable, "-m", "celery", "-A", APP_MODULE, "worker", "-P", "prefork",
        "-c", str(concurrency), "-n", host, "-l", loglevel,
        "--without-mingle", "--without-gossip", f"--ojs-ml-capabilities={capabilities}",
    ]  # fmt: skip


@contextmanager
def worker_processes(
    broker: str, logdir: Path, *, verbose: bool = False
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start one worker process per node; stop them all (by pid) on exit.

    Their output goes to `<logdir>/<node>.log`, or to this process's stderr when verbose.
    """
    env = {**os.environ, BROKER_ENV: broker}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for host, capabilities in FLEET.items():
            argv = worker_argv(
                host, capabilities, CONCURRENCY.get(host, 2), "INFO" if verbose else "WARNING"
            )
            with (logdir / f"{host}.log").open("wb") as log:
                out = None if verbose else log
                procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
        yield procs
    finally:
        stop(procs)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process, wait for all of them, SIGKILL the ones still alive."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def check_alive(procs: list[subprocess.Popen[bytes]], logdir: Path) -> None:
    """ConfigError with the log tail of the first worker that exited (the logs' temporary
    directory is removed when the run ends)."""
    for host, proc in zip(FLEET, procs, strict=False):
        if proc.poll() is not None:
            tail = (logdir / f"{host}.log").read_text(errors="replace")[-3000:]
            raise ConfigError(f"worker {host} exited with {proc.returncode}:\n{tail}")


def run_on_redis(
    broker: str,
    printer: LivePrinter,
    *,
    timeout_s: float = 40.0,
    examples: Path = EXAMPLES,
    start_workers: bool = True,
    verbose: bool = False,
) -> session.Outcome:
    """Run one session on Redis, starting (and stopping) the fleet unless it is external."""
    app = make_app(broker)
    store: OJSStore = app.ojs_ml.store
    if not store.ping():
        raise ConfigError(f"cannot reach Redis at {broker}; start it or pass another --broker")
    submissions = session.prepare(examples)
    who = "3 worker processes" if start_workers else "external workers"
    printer.say(f"Fleet ({who}, broker and store {broker}):")
    for line in session.fleet_banner(fleet_capabilities(), "CUDA_VISIBLE_DEVICES per task"):
        printer.say(line)
    with tempfile.TemporaryDirectory(prefix="ojs-ml-demo-") as tmp, ExitStack() as stack:
        logdir = Path(tmp)
        procs = (
            stack.enter_context(worker_processes(broker, logdir, verbose=verbose))
            if start_workers
            else []
        )
        _wait(store, procs, logdir, 60.0 if start_workers else 120.0)
        outcome = session.run(app, submissions, printer, timeout_s=timeout_s)
        if start_workers:
            discard_waiting(store, outcome.rows)
    app.close()
    return outcome


def _wait(
    store: OJSStore, procs: list[subprocess.Popen[bytes]], logdir: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        check_alive(procs, logdir)
        try:
            session.wait_for_fleet(store, FLEET, timeout_s=0.5)
            return
        except ConfigError:
            if time.monotonic() > deadline:
                raise


def discard_waiting(store: OJSStore, rows: list[Row]) -> int:
    """Remove the messages and pending records of the jobs still waiting; how many went.

    Only those task ids' messages, never whole queues."""
    pending = store.pending()
    removed = 0
    for row in rows:
        record = pending.get(row.job.task_id)
        if row.state != WAITING or record is None:
            continue
        queue = queue_name(str(record["queue"]), str(record["class_id"]), str(record["band"]))
        removed += _remove_message(store.client, queue, row.job.task_id)
        store.clear_pending(row.job.task_id)
    return removed


def _remove_message(client: Any, queue: str, task_id: str) -> int:
    removed = 0
    for key in (queue + suffix for suffix in PRIORITY_SUFFIXES):
        for raw in client.lrange(key, 0, -1):
            try:
                headers = json.loads(raw).get("headers") or {}
            except (ValueError, AttributeError):
                continue
            if headers.get("id") == task_id:
                removed += int(client.lrem(key, 1, raw))
    return removed
