"""Checkpoint fixtures: storage backends on a tmp dir and on a real S3 API (moto) on loopback.

The S3 endpoint is `moto_server` in a subprocess bound to 127.0.0.1, so the
s3fs code path runs unchanged against a real HTTP S3 API and nothing leaves
the host. Credentials are dummies; instance-metadata lookups are disabled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pytest

from celery_ojs_ml.checkpoint import CheckpointSettings, clear_storage_options, reset_flag
from celery_ojs_ml.checkpoint.preempt import SIGNAL
from celery_ojs_ml.spec.bounds import Bounds
from tests.helpers import free_port, stop_process

_MOTO_START_TIMEOUT_S = 30.0


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_771_502_400.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Backend:
    """One storage backend: its checkpoint prefix and the fsspec options to reach it."""

    name: str
    storage_uri: str
    options: dict[str, Any] = field(default_factory=dict)

    def settings(self, **overrides: Any) -> CheckpointSettings:
        """Checkpoint settings on this backend."""
        values: dict[str, Any] = {
            "storage_uri": self.storage_uri,
            "storage_options": self.options,
            "enabled": True,
            "bounds": self.bounds(),
            **overrides,
        }
        return CheckpointSettings(**values)

    def bounds(self, **overrides: Any) -> Bounds:
        """The allow-lists with the test's tmp dir granted to a `file://` backend (a local
        checkpoint directory must be: OJS ML Extensions §12.1), plus `overrides`."""
        root = self.storage_uri.rstrip("/").rsplit("/", 1)[0] + "/"
        granted = (root,) if self.name == "file" else ()
        return Bounds(**{"checkpoint_prefixes": granted, **overrides})

    def fs(self, uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
        """A fresh (uncached) filesystem for `uri`, so listings reflect the server."""
        fs, path = fsspec.core.url_to_fs(uri, skip_instance_cache=True, **self.options)
        return fs, str(path)

    def exists(self, uri: str) -> bool:
        """Whether the object or file at `uri` exists."""
        fs, path = self.fs(uri)
        return bool(fs.exists(path))

    def read(self, uri: str) -> bytes:
        """The content of the object or file at `uri`."""
        fs, path = self.fs(uri)
        return bytes(fs.cat_file(path))

    def find(self, uri: str) -> list[str]:
        """Every file under the prefix `uri`, as paths relative to it."""
        fs, path = self.fs(uri)
        root = path.rstrip("/") + "/"
        return sorted(str(p)[len(root) :] for p in fs.find(root))


def _wait_for_http(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + _MOTO_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"moto_server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    pytest.fail(f"moto_server did not answer within {_MOTO_START_TIMEOUT_S} s:\n{log.read_text()}")


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`http://127.0.0.1:<port>` of a private moto S3 server that lives for the session."""
    workdir = tmp_path_factory.mktemp("moto")
    port = free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    log = workdir / "moto.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=workdir, stdout=out, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_for_http(f"{endpoint}/moto-api/", proc, log)
        yield endpoint
    finally:
        stop_process(proc)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Dummy AWS credentials; no config files, no instance-metadata lookups.

    A client built without an explicit endpoint goes to a closed loopback port,
    so a bug that drops the storage options can never reach the real AWS.
    """
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


def s3_options(endpoint: str) -> dict[str, Any]:
    """fsspec options that point s3fs at `endpoint` and fail fast."""
    return {
        "client_kwargs": {"endpoint_url": endpoint},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
    }


@pytest.fixture
def s3_backend(s3_endpoint: str, aws_env: None) -> Backend:
    """A fresh bucket on the moto server."""
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    options = s3_options(s3_endpoint)
    fs, _ = fsspec.core.url_to_fs(f"s3://{bucket}/", skip_instance_cache=True, **options)
    fs.mkdir(bucket)
    return Backend("s3", f"s3://{bucket}/checkpoints/", options)


@pytest.fixture
def file_backend(tmp_path: Path) -> Backend:
    """A checkpoint prefix in the test's tmp dir."""
    return Backend("file", f"file://{tmp_path}/checkpoints/")


@pytest.fixture(params=["file", "s3"])
def backend(request: pytest.FixtureRequest) -> Backend:
    """Each storage backend in turn."""
    found: Backend = request.getfixturevalue(f"{request.param}_backend")
    return found


@pytest.fixture
def clock() -> FakeClock:
    """A hand-moved clock."""
    return FakeClock()


@pytest.fixture(autouse=True)
def _isolated_process_state() -> Iterator[None]:
    """No preemption flag, storage-option registry or SIGUSR2 handler leaks between tests."""
    previous = signal.getsignal(SIGNAL)
    reset_flag()
    clear_storage_options()
    yield
    reset_flag()
    clear_storage_options()
    signal.signal(SIGNAL, previous)


@pytest.fixture
def child_env(aws_env: None) -> dict[str, str]:
    """The environment for a child Python process (inherits the dummy AWS credentials)."""
    return dict(os.environ)
