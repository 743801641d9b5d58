"""A RabbitMQ broker of the chaos campaign's own (`--topology rabbitmq`).

One `rabbitmq-server` node under a name, ports and directories of its own (AMQP on a
free loopback port, Erlang distribution on another, its database, logs and cookie in
the campaign's directory), so it neither touches nor needs a system RabbitMQ. Celery's
queues are durable and its messages persistent, so a restart (`rabbitmqctl stop`, then
a start on the same port) keeps what was queued and unacked.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from contextlib import suppress
from pathlib import Path

from bench.chaos_servers import free_port

_START_TIMEOUT_S = 90.0
_BIN = Path("/usr/lib/rabbitmq/bin")
"""The scripts themselves: Debian's /usr/sbin wrappers switch to the `rabbitmq` user,
who may not write the campaign's directory."""


def _script(name: str) -> str:
    own = _BIN / name
    found = str(own) if own.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed (apt-get install rabbitmq-server)")
    return found


class RabbitServer:
    """One RabbitMQ node; `url` for Celery, `restart()` for the `broker` fault."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.name = name
        self.port, self.dist_port = free_port(), free_port()
        self.node = f"chaos{self.port}@localhost"
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "enabled_plugins").write_text("[].\n")
        self.log = workdir / f"{name}.log"
        self.env = {
            **os.environ,
            "HOME": str(self.dir),  # the Erlang cookie of this node and of rabbitmqctl
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_PID_FILE": str(self.dir / "node.pid"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq"),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self) -> RabbitServer:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [_script("rabbitmq-server")], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        return self

    def _answers(self) -> bool:
        """Whether the node accepts AMQP connections and has booted."""
        with suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
            done = subprocess.run(
                [_script("rabbitmqctl"), "-n", self.node, "await_startup", "--timeout", "5"],
                env=self.env, capture_output=True, timeout=30, check=False,
            )  # fmt: skip
            return done.returncode == 0
        return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with suppress(subprocess.TimeoutExpired):
            subprocess.run(
                [_script("rabbitmqctl"), "-n", self.node, "stop"],
                env=self.env, capture_output=True, timeout=60, check=False,
            )  # fmt: skip
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait()

    def restart(self, down_s: float = 0.0) -> float:
        """Stop, stay down `down_s`, start; returns the seconds it did not answer."""
        began = time.monotonic()
        self.stop()
        time.sleep(down_s)
        self.start()
        return time.monotonic() - began
