"""The chaos campaign's store behind Redis Sentinel: two data nodes and three sentinels.

Both data nodes keep an append-only file; the sentinels (quorum 2) promote the replica
half a second after the primary stops answering. A `store` fault here is a failover:
the primary is SIGKILLed (its host died), the sentinels promote the replica, and the
old primary comes back as the new primary's replica, ready for the next failover. The
processes are real `redis-server`s on free loopback ports, as `RedisServer`'s.
"""

from __future__ import annotations

import signal
import time
from contextlib import suppress
from pathlib import Path

import redis
from redis.sentinel import MasterNotFoundError, Sentinel

from bench.chaos_servers import RedisServer

MASTER = "chaosmaster"
DOWN_AFTER_MS = 500
FAILOVER_TIMEOUT_MS = 3000


class DataNode(RedisServer):
    """A data node; `replica_of` a port makes it start as that node's replica."""

    replica_of: int | None = None

    def argv(self) -> list[str]:
        argv = super().argv()
        return (
            [*argv, "--replicaof", "127.0.0.1", str(self.replica_of)] if self.replica_of else argv
        )


class SentinelNode(RedisServer):
    """A sentinel monitoring `primary` as `MASTER`."""

    def __init__(self, name: str, workdir: Path, primary: int) -> None:
        super().__init__(name, workdir, aof=False)
        self.conf = workdir / f"{name}.conf"
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndaemonize no\ndir {self.dir}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
            f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER} 1\n"
        )

    def argv(self) -> list[str]:
        return [super().argv()[0], str(self.conf), "--sentinel", "--port", str(self.port)]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            with suppress(redis.RedisError), redis.Redis(port=self.port, socket_timeout=1) as c:
                if c.ping():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.05)


class SentinelStore:
    """The store: `url`/`options` for clients, `restart()` for a failover."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [DataNode("store-a", workdir), DataNode("store-b", workdir)]
        self.nodes[1].replica_of = self.nodes[0].port
        self.sentinels = [
            SentinelNode(f"sentinel{i}", workdir, self.nodes[0].port) for i in range(3)
        ]
        self.failovers = 0

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://127.0.0.1:{s.port}" for s in self.sentinels) + "/0"

    @property
    def options(self) -> dict[str, str]:
        return {"master_name": MASTER}

    def start(self) -> SentinelStore:
        for node in (*self.nodes, *self.sentinels):
            node.start()
        self._until("the replica to sync and the sentinels to see it", self._ready)
        return self

    def stop(self) -> None:
        for node in (*self.sentinels, *self.nodes):
            node.stop()

    def primary_port(self) -> int | None:
        sentinel = Sentinel([("127.0.0.1", s.port) for s in self.sentinels], socket_timeout=1)
        try:
            return int(sentinel.discover_master(MASTER)[1])
        except (MasterNotFoundError, redis.RedisError):
            return None
        finally:
            sentinel.close()

    def restart(self, down_s: float = 0.0) -> float:
        """A failover: SIGKILL the primary, wait until the sentinels promoted the replica
        and it takes writes, then start the old primary again as its replica; returns
        the seconds no primary took writes."""
        self._until("the replica to be in sync", self._ready)
        old = next(n for n in self.nodes if n.port == self.primary_port())
        new = next(n for n in self.nodes if n is not old)
        began = time.monotonic()
        assert old.proc is not None
        old.proc.send_signal(signal.SIGKILL)
        old.proc.wait()
        self._until("the promotion", lambda: self._takes_writes(new))
        lasted = time.monotonic() - began
        time.sleep(down_s)
        old.replica_of = new.port
        old.start()
        new.replica_of = None
        self.failovers += 1
        return lasted

    def _ready(self) -> bool:
        primary = self.primary_port()
        replicas = [n for n in self.nodes if n.port != primary]
        if primary is None or len(replicas) != 1:
            return False
        with redis.Redis(port=replicas[0].port, socket_timeout=1) as client:
            info = client.info("replication")
        if info.get("role") != "slave" or info.get("master_link_status") != "up":
            return False
        for node in self.sentinels:
            with redis.Redis(port=node.port, socket_timeout=1) as client:
                state = client.sentinel_master(MASTER)
            if int(state.get("num-slaves", 0)) < 1 or int(state.get("num-other-sentinels", 0)) < 2:
                return False
        return True

    def _takes_writes(self, node: DataNode) -> bool:
        if self.primary_port() != node.port:
            return False
        with redis.Redis(port=node.port, socket_timeout=1) as client:
            return client.info("replication").get("role") == "master"

    def _until(self, what: str, check: object, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with suppress(redis.RedisError):
                if callable(check) and check():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.1)
