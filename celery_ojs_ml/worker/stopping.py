"""Stopping one pool child: the one way fencing, preemption and gang stops end a job early.

Key decision: only a prefork child can be stopped alone (other pools run tasks
in the main process), and it is killed through the pool (`terminate_job(pid,
SIGKILL)`), never `revoke(terminate=True)`, which would blocklist the task id
and drop its re-published copy. A copy whose child has not reported its pid yet
is looked at again every `UNSTARTED_S` until it does.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from celery_ojs_ml.worker.running import Running

log = logging.getLogger("celery_ojs_ml.worker.core")
UNSTARTED_S = 0.1
"""How soon a job that no pool child has accepted yet is looked at again."""
_ACCEPT_WAIT_S = 30.0
"""How long a stopped copy without a known process is waited for before giving up."""


class ChildStopper:
    """Kills the pool child running a request (see module doc)."""

    def __init__(self, consumer: Any, prefork: bool, running: Running) -> None:
        self.c, self.prefork, self.running = consumer, prefork, running

    def stop_child(self, req: Any) -> None:
        """Kill the pool child running `req`, a request in `fenced` or `stopping` (a gang
        rank whose peer failed): now, or once the child reports it started."""
        pid = getattr(req, "worker_pid", None)
        if pid is None and self.prefork:
            self._kill_once_accepted(req, time.monotonic() + _ACCEPT_WAIT_S)
        elif not self.kill_child(pid):
            log.warning("ojs-ml: a non-prefork pool cannot stop %s; it runs on", req.id)

    def _kill_once_accepted(self, req: Any, until: float) -> None:
        """Kill a copy being stopped whose child has not reported it started yet (no pid:
        for a fenced copy, the worker stalled between writing the lease and reading the
        child's ack); the event loop reads that ack soon."""
        pid = getattr(req, "worker_pid", None)
        if req not in self.running.fenced and req not in self.running.stopping:
            return  # it ended meanwhile (its failure path or release discarded it)
        if pid is not None:
            self.kill_child(pid)
            return
        timer = getattr(self.c, "timer", None)
        if timer is None or time.monotonic() > until:
            log.warning("ojs-ml: the stopped copy of %s never reported its process", req.id)
            return
        timer.call_after(UNSTARTED_S, self._kill_once_accepted, (req, until))

    def kill_child(self, pid: int | None) -> bool:
        """SIGKILL the pool child `pid` through the pool; False where one task cannot be
        stopped (not prefork, or no pid)."""
        if not self.prefork or not pid or pid == os.getpid():
            return False
        terminate = getattr(self.c.pool, "terminate_job", None)
        if terminate is not None:
            terminate(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return True
