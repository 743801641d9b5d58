"""The chaos campaign's workers: `celery -A bench.chaos_app worker` subprocesses.

Each worker is its own process group (main process, pool children and the spawned
scheduler candidate), so a SIGKILL takes the whole node down at once. A stall stops
the main process only, as a frozen main process or a partition does: its pool
children run on, which is what the lease fencing must handle.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
CAPABILITIES = "profile:nvidia-a100x2"


class ChaosWorker:
    """One worker; `busy` is held while a fault works on it, so faults do not pile up on
    one worker (a restart through a cut proxy would test the start-up, not the fault)."""

    def __init__(self, name: str, env: dict[str, str], logdir: Path, concurrency: int) -> None:
        self.name = name
        self.hostname = f"{name}@chaos"
        self.log = logdir / f"{name}.log"
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        self.argv = [
            sys.executable, "-m", "celery", "-A", "bench.chaos_app", "worker",
            "-n", self.hostname, "-P", "prefork", "-c", str(concurrency), "-l", "INFO",
            "--without-mingle", "--without-gossip", f"--ojs-ml-capabilities={CAPABILITIES}",
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.busy = threading.Lock()
        self.starts = 0

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole worker (main process, pool children, candidate)."""
        if self.proc is None:
            return
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 20.0) -> None:
        """A warm shutdown (SIGTERM), then SIGKILL if it takes too long."""
        if not self.alive():
            return
        assert self.proc is not None
        with suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        with suppress(ProcessLookupError):  # pool children orphaned by a warm shutdown
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stall(self, seconds: float) -> None:
        """SIGSTOP the main process for `seconds`, then SIGCONT that same process."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            with suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)

    def candidate_pid(self) -> int | None:
        """The pid of this worker's scheduler candidate (a spawned child), if it runs."""
        if not self.alive():
            return None
        assert self.proc is not None
        with suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children():
                with suppress(psutil.Error):  # a killed one, until its parent reaps it
                    if any("spawn_main" in part for part in child.cmdline()):
                        return int(child.pid)
        return None

    def exit_reason(self) -> str:
        """Why the worker exited on its own: its last CRITICAL log line, or the exit code."""
        lines = self.tail(400_000).splitlines()
        critical = [line for line in lines if "CRITICAL/" in line]
        code = None if self.proc is None else self.proc.returncode
        return critical[-1].split("] ", 1)[-1] if critical else f"exit code {code}"

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""
