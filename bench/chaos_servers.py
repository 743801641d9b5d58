"""Servers of the chaos campaign (`bench/chaos.py`): redis-server processes and a TCP proxy.

Every server is a real `redis-server` on a free loopback port (never 6379), restarted
on the same port so clients reconnect to it. The store and the broker run with an
append-only file fsynced every second (`--appendonly yes --appendfsync everysec`), the
store's recommended configuration (docs/operations.md), so a restart keeps what they
held; the ledger keeps no file and is never faulted. The proxy sits between one
worker and the store and can cut that worker off: it closes every connection and
refuses new ones until healed.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from contextlib import suppress
from pathlib import Path

import redis

_START_TIMEOUT_S = 30.0


def free_port() -> int:
    """A free loopback port; never Redis' default 6379."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port != 6379:
            return port


class RedisServer:
    """One redis-server on a fixed port; `restart()` stops it (SIGTERM, which writes
    and fsyncs the AOF) and starts it again on the same port and directory."""

    def __init__(self, name: str, workdir: Path, *, aof: bool = True) -> None:
        self.name, self.aof = name, aof
        self.port = free_port()
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH (apt-get install redis-server)")
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--dir", str(self.dir), "--daemonize", "no"]
        if self.aof:
            return [*argv, "--appendonly", "yes", "--appendfsync", "everysec"]
        return [*argv, "--appendonly", "no"]

    def start(self) -> RedisServer:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=subprocess.STDOUT)
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        """Until it answers PING and has loaded its data."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        client = redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2)
        try:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-2000:]}")
                with suppress(redis.RedisError):
                    if client.ping() and not int(client.info("persistence").get("loading", 0)):
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.name} did not start:\n{self.log.read_text()[-2000:]}"
                    )
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self, down_s: float = 0.0) -> float:
        """Stop, stay down `down_s`, start; returns the seconds it did not answer."""
        began = time.monotonic()
        self.stop()
        time.sleep(down_s)
        self.start()
        return time.monotonic() - began


class Proxy:
    """A loopback TCP proxy in threads: `listen` port -> `target` port, which `cut()`
    severs (every open connection closed, new ones closed at once) until `heal()`."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(128)
        self.port = int(self.server.getsockname()[1])
        self.cut_off = False
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True).start()

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cut(self) -> None:
        with self._lock:
            self.cut_off = True
            for sock in self._open:
                _close(sock)
            self._open.clear()

    def heal(self) -> None:
        with self._lock:
            self.cut_off = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self.server)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.cut_off:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:  # the store is down: the client sees it as such
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
            _close(src)
            _close(dst)


def _close(sock: socket.socket) -> None:
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with suppress(OSError):
        sock.close()
