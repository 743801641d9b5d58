"""The fleet scheduler candidate in its own process (`ojs_ml_scheduler = "auto"`).

Key decisions: a spawned process, not a thread: a leader thread in the worker's
main process competes with the gate for the GIL (docs/scheduling.md
"Performance"); spawned, not forked, so it inherits neither the pool's pipes
nor the broker connections. The child imports the app by its module path;
where none is found, or the broker is `memory://`, the candidate runs as a
thread instead. The child dies with its worker (`PR_SET_PDEATHSIG`, plus a
parent-pid watch) and resigns the lock on SIGTERM, so a warm shutdown hands
the lead over at once.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
from typing import Any

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_LOG_FORMAT = "[%(asctime)s: %(levelname)s/OJSScheduler] %(message)s"


def app_path(app: Any) -> str | None:
    """`module:attribute` of a module-level name bound to `app`, or None."""
    for name, module in list(sys.modules.items()):
        if module is None or name == "__main__" or name.startswith(("celery.", "kombu.")):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            if value is app and not attr.startswith("_"):
                return f"{name}:{attr}"
    return None


class CandidateProcess:
    """A spawned process running one scheduler candidate; `stop()` ends it."""

    def __init__(self, path: str, candidate: str, level: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._leading = ctx.Value("b", 0, lock=False)
        self.proc = ctx.Process(
            target=child_main,
            args=(path, candidate, os.getpid(), level, self._leading),
            name="ojs-ml-scheduler",
            daemon=True,
        )

    def start(self) -> CandidateProcess:
        self.proc.start()
        return self

    @property
    def leading(self) -> bool:
        """Whether the candidate holds the scheduler lock (mirrored within 0.5 s)."""
        return bool(self._leading.value) and self.proc.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (it resigns the lock), then SIGKILL after `timeout_s`."""
        if self.proc.pid is None or not self.proc.is_alive():
            return
        self.proc.terminate()
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(1.0)


def start_candidate(app: Any, candidate: str, *, thread: bool = False) -> Any:
    """A running candidate for `app`: a process where possible, else a thread (see above)."""
    from .loop import FleetScheduler

    in_memory = str(app.conf.broker_url or "").startswith("memory://")
    path = None if thread or in_memory else app_path(app)
    if path is not None:
        log.info("ojs-ml: the scheduler candidate runs in its own process (%s)", path)
        return CandidateProcess(path, candidate, logging.getLogger().getEffectiveLevel()).start()
    log.info("ojs-ml: the scheduler candidate runs in a thread of this worker")
    loop = FleetScheduler(app, candidate=candidate)
    threading.Thread(target=loop.run, name="ojs-ml-scheduler", daemon=True).start()
    return loop


def child_main(path: str, candidate: str, parent_pid: int, level: int, leading: Any = None) -> None:
    """Entry point of the spawned process: import the app, lead when elected; `leading`
    (a shared byte) mirrors whether it leads, for the worker's `inspect stats`."""
    logging.basicConfig(level=level, format=_LOG_FORMAT, stream=sys.stderr)
    _die_with_parent()
    module, _, attr = path.partition(":")
    app = getattr(importlib.import_module(module), attr)
    from .loop import FleetScheduler

    loop = FleetScheduler(app, candidate=candidate)
    signal.signal(signal.SIGTERM, lambda *_: loop.stop())
    signal.signal(signal.SIGINT, lambda *_: loop.stop())
    watch = threading.Thread(target=_watch_parent, args=(parent_pid, loop, leading), daemon=True)
    watch.start()
    loop.run()


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        log.debug("ojs-ml: no prctl; the scheduler watches its parent's pid instead")


def _watch_parent(parent_pid: int, loop: Any, leading: Any = None) -> None:
    """Stop the candidate once the worker that started it is gone; meanwhile mirror
    whether it leads into `leading`."""
    while os.getppid() == parent_pid:
        if leading is not None:
            leading.value = int(loop.leading)
        if loop.wait_stopped(0.5):
            return
    loop.stop()
