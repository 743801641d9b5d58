"""Real `celery worker` processes for the integration tests, started and stopped by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from celery_ojs_ml.store.registry import OJSStore

ROOT = Path(__file__).resolve().parents[2]
_START_TIMEOUT_S = 30.0


class WorkerProcess:
    """One `celery -A tests.integration.mlapp worker` subprocess."""

    def __init__(
        self,
        name: str,
        broker: str,
        capabilities: str,
        logdir: Path,
        *,
        pool: str = "prefork",
        concurrency: int = 4,
        results_url: str | None = None,
        app: str = "tests.integration.mlapp:app",
        extra_env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
        queue: str = "celery",
    ) -> None:
        self.name = name
        self.hostname = f"{name}@test"
        self.log = logdir / f"{name}.log"
        self.argv = [
            sys.executable, "-m", "celery", "-A", app, "worker",
            "-n", self.hostname, "-P", pool, "-c", str(concurrency), "-l", "INFO",
            "--without-mingle", "--without-gossip", "-Q", queue,
            f"--ojs-ml-capabilities={capabilities}", *extra_args,
        ]  # fmt: skip
        self.env = {
            **os.environ,
            "OJS_TEST_BROKER": broker,
            "OJS_TEST_RESULTS": results_url or broker,
            "PYTHONPATH": str(ROOT),
            **(extra_env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        return self

    def wait_live(self, store: OJSStore) -> None:
        """Block until the worker has advertised itself in the store."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"worker {self.name} exited:\n{self.log.read_text()[-4000:]}")
            if self.hostname in store.live_workers():
                return
            time.sleep(0.1)
        tail = self.log.read_text()[-4000:]
        raise AssertionError(f"worker {self.name} never advertised:\n{tail}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL the worker and its pool children at once, as if the node died."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def wait_for_leader(store: OJSStore, timeout_s: float = 20.0) -> None:
    """Block until a scheduler is elected: a test whose premise is jobs arriving one by
    one at a running scheduler publishes after this (under load the first leader has
    taken 2 s to start, and jobs sent before then are all placed in one pass)."""
    from celery_ojs_ml.store.pending import PendingBook

    deadline = time.monotonic() + timeout_s
    while PendingBook(store).leader() is None:
        assert time.monotonic() < deadline, "no scheduler was elected"
        time.sleep(0.05)


@contextmanager
def running(workers: list[WorkerProcess], store: OJSStore) -> Iterator[list[WorkerProcess]]:
    """Start workers, wait until each has advertised, stop them all afterwards."""
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.wait_live(store)
        yield workers
    finally:
        for worker in workers:
            worker.stop()


class EventLog:
    """Celery events of `kinds`, received in a thread from the broker (workers run with
    `-E`), until `done(events)` holds or `timeout_s` passes; use as a context manager
    around what sends them."""

    def __init__(
        self,
        app: Any,
        kinds: tuple[str, ...],
        done: Callable[[list[dict[str, Any]]], bool],
        timeout_s: float = 60.0,
    ) -> None:
        self.app, self.kinds, self.done, self.timeout_s = app, kinds, done, timeout_s
        self.events: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._capture, daemon=True)

    def __enter__(self) -> EventLog:
        self.thread.start()
        assert self.ready.wait(5), "the event receiver did not start"
        time.sleep(0.3)  # the receiver's queue is bound once it consumes
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(self.timeout_s)

    def first(self, kind: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["type"] == kind), None)

    def _capture(self) -> None:
        with self.app.connection_for_read() as conn:
            receiver = self.app.events.Receiver(conn, handlers={}, app=self.app)

            def on_event(event: dict[str, Any]) -> None:
                self.events.append(event)
                receiver.should_stop = self.done(self.events)

            receiver.handlers = dict.fromkeys(self.kinds, on_event)
            self.ready.set()
            with suppress(Exception):  # a timeout: the test's assertions on `events` say it
                receiver.capture(limit=None, timeout=self.timeout_s, wakeup=False)
