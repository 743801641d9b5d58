"""Shared fixtures: a private redis-server for the whole session, and clients on it.

The server is started on a free loopback port (never 6379) with persistence off,
so the tests cannot touch a developer's Redis and leave nothing behind.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import hypothesis  # noqa: F401  (see below)
import pytest
import redis

from celery_ojs_ml.store.registry import OJSStore
from tests.helpers import free_port, stop_process

_REDIS_START_TIMEOUT_S = 10.0

# hypothesis is imported above, before any test runs: otherwise its pytest plugin imports
# it (through pytest's assertion rewriting) in the terminal summary, and on CPython 3.11.7
# that compile can fail with "SystemError: AST constructor recursion depth mismatch" after
# a test that ran the click CLI, so a run of such a test alone exited 1 although it passed.


def _wait_for_ping(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + _REDIS_START_TIMEOUT_S
    with redis.Redis.from_url(url, socket_timeout=1) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"redis-server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
    pytest.fail(
        f"redis-server did not answer PING within {_REDIS_START_TIMEOUT_S} s:\n{log.read_text()}"
    )


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`redis://127.0.0.1:<port>/0` of a private redis-server that lives for the session."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "redis-server is a test prerequisite but is not on PATH; "
            "install it, e.g. `apt-get install redis-server`"
        )
    workdir = tmp_path_factory.mktemp("redis")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    argv += ["--daemonize", "no", "--dir", str(workdir)]
    log = workdir / "redis.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=workdir, stdout=out, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_for_ping(url, proc, log)
        yield url
    finally:
        stop_process(proc)


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client (bytes responses) on the private server, emptied before the test."""
    client = redis.Redis.from_url(redis_url, decode_responses=False)
    client.flushall()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def store(redis_client: redis.Redis) -> OJSStore:
    """An `OJSStore` on the private server under a fresh key prefix."""
    return OJSStore(redis_client, prefix=f"test-{uuid.uuid4().hex[:8]}")
