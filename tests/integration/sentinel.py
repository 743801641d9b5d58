"""Redis Sentinel on loopback for the store tests: a primary, a replica, three sentinels.

Every process is a real `redis-server` (`--sentinel` for the sentinels) on a free port,
with persistence off on the data nodes and a short `down-after-milliseconds`, so a
killed primary is replaced within seconds. Processes are stopped by their own pid.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.sentinel import MasterNotFoundError, Sentinel

from tests.helpers import free_port, stop_process

MASTER = "mymaster"
DOWN_AFTER_MS = 500
FAILOVER_TIMEOUT_MS = 3000
_START_TIMEOUT_S = 20.0


@dataclass
class Node:
    """One redis-server process (a data node or a sentinel)."""

    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def kill(self) -> None:
        """SIGKILL: the host died; nothing it had not sent to its replica survives."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            stop_process(self.proc)


@dataclass
class SentinelSetup:
    """A primary, its replica and the sentinels that monitor them as `MASTER`."""

    primary: Node
    replica: Node
    sentinels: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The store URL, in kombu's sentinel form (the database in the last URL)."""
        joined = ";".join(f"sentinel://127.0.0.1:{s.port}" for s in self.sentinels)
        return joined + "/0"

    @property
    def options(self) -> dict[str, str]:
        return {"master_name": MASTER}

    def master_port(self) -> int | None:
        """The primary's port as the sentinels report it now (None: none agreed yet)."""
        sentinel = Sentinel([("127.0.0.1", s.port) for s in self.sentinels], socket_timeout=1)
        try:
            return int(sentinel.discover_master(MASTER)[1])
        except (MasterNotFoundError, redis.RedisError):
            return None
        finally:
            sentinel.close()

    def wait_failover(self, timeout_s: float = 60.0) -> int:
        """Block until the sentinels report the replica as the primary, and it takes writes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.master_port() == self.replica.port:
                with self.replica.client() as client, suppress(redis.RedisError):
                    if client.info("replication").get("role") == "master":
                        return self.replica.port
            time.sleep(0.1)
        raise AssertionError(f"no failover to the replica within {timeout_s} s")

    def stop(self) -> None:
        for node in (*self.sentinels, self.replica, self.primary):
            node.stop()


def _binary() -> str:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is a test prerequisite (apt-get install redis-server)"
    return binary


def _start(argv: list[str], workdir: Path, name: str) -> Node:
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=workdir, stdout=out, stderr=subprocess.STDOUT)
    return Node(int(argv[argv.index("--port") + 1]), proc, log)


def _data_node(workdir: Path, name: str, primary: int | None = None) -> Node:
    port = free_port()
    folder = workdir / name
    folder.mkdir()
    argv = [_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--daemonize", "no", "--dir", str(folder)]
    if primary is not None:
        argv += ["--replicaof", "127.0.0.1", str(primary)]
    return _start(argv, workdir, name)


def _sentinel(workdir: Path, name: str, primary: int) -> Node:
    port = free_port()
    conf = workdir / f"{name}.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {workdir}\n"
        f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
        f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
        f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
        f"sentinel parallel-syncs {MASTER} 1\n"
    )
    return _start([_binary(), str(conf), "--sentinel", "--port", str(port)], workdir, name)


def _wait(what: str, check: object, nodes: list[Node]) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        for node in nodes:
            if node.proc.poll() is not None:
                raise AssertionError(f"{node.log.name} exited:\n{node.log.read_text()}")
        with suppress(redis.RedisError):
            if callable(check) and check():
                return
        time.sleep(0.1)
    logs = "\n".join(f"{n.log.name}:\n{n.log.read_text()[-2000:]}" for n in nodes)
    raise AssertionError(f"timed out waiting for {what}:\n{logs}")


def _replica_in_sync(setup: SentinelSetup) -> bool:
    with setup.replica.client() as client:
        info = client.info("replication")
    return bool(info.get("role") == "slave" and info.get("master_link_status") == "up")


def _sentinels_see_all(setup: SentinelSetup) -> bool:
    for node in setup.sentinels:
        with node.client() as client:
            state = client.sentinel_master(MASTER)
        if int(state.get("num-slaves", 0)) < 1 or int(state.get("num-other-sentinels", 0)) < 2:
            return False
    return True


@contextmanager
def sentinel_setup(workdir: Path, sentinels: int = 3) -> Iterator[SentinelSetup]:
    """Start a primary, a replica in sync with it, and `sentinels` sentinels (quorum 2)
    that know both and each other; stop them all afterwards."""
    workdir.mkdir(parents=True, exist_ok=True)
    primary = _data_node(workdir, "primary")
    setup = SentinelSetup(primary, _data_node(workdir, "replica", primary.port))
    try:
        _wait("the replica to sync", lambda: _replica_in_sync(setup), [primary, setup.replica])
        for n in range(sentinels):
            setup.sentinels.append(_sentinel(workdir, f"sentinel{n}", primary.port))
        nodes = [primary, setup.replica, *setup.sentinels]
        _wait(
            "the sentinels to see the replica and each other",
            lambda: _sentinels_see_all(setup),
            nodes,
        )
        yield setup
    finally:
        setup.stop()
