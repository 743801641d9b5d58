"""The store over TLS (`rediss://`) and as a Redis ACL user limited to its own keys.

A private redis-server with TLS on a free loopback port, with a throwaway CA,
server and client certificate made by `openssl`; nothing is trusted beyond the
test. The ACL user is created from the exact `ACL SETUSER` line in
docs/security.md, so the documented recipe is the one that is tested.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from celery_ojs_ml.checkpoint import CheckpointMeta, records
from celery_ojs_ml.checkpoint.preempt import (
    clear_preemption,
    preemption_requested,
    request_preemption,
)
from celery_ojs_ml.store.deadletter import dead_jobs, dead_letter
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.registry import OJSStore
from tests.helpers import ROOT, free_port, stop_process

pytestmark = pytest.mark.integration

PASSWORD = "s3cret-" + uuid.uuid4().hex[:8]
CONSTRAINTS = {"ext_ml_gpu_count": 1, "ext_ml_gpu_type": "nvidia-a100"}
_START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class TLSServer:
    port: int
    certs: Path

    def url(self, user: str = "", **query: str) -> str:
        """A `rediss://` URL with the given redis-py query parameters."""
        auth = f"{user}:{quote(PASSWORD)}@" if user else ""
        params = "&".join(f"{k}={quote(v, safe='/')}" for k, v in query.items())
        return f"rediss://{auth}127.0.0.1:{self.port}/0" + (f"?{params}" if params else "")

    def verified(self, user: str = "", **extra: str) -> str:
        """A URL that verifies the server against the test CA."""
        ca = str(self.certs / "ca.crt")
        checks = {"ssl_cert_reqs": "required", "ssl_check_hostname": "true"}
        return self.url(user, **checks, ssl_ca_certs=ca, **extra)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_certs(workdir: Path) -> None:
    """A CA, a server certificate for IP 127.0.0.1, and a client certificate."""
    ca = ["-subj", "/CN=ojs-test-ca", "-keyout", "ca.key", "-out", "ca.crt"]
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", *ca, cwd=workdir)
    (workdir / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        subject = ["-subj", f"/CN=ojs-test-{name}", "-keyout", f"{name}.key"]
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", *subject, "-out", f"{name}.csr", cwd=workdir
        )
        signer = ["-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1"]
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", *signer, "-out", f"{name}.crt", *ext, cwd=workdir
        )


def _wait_for_tls(server: TLSServer, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    with redis.Redis.from_url(server.verified(), socket_timeout=1) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                _no_tls(log.read_text())
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
    pytest.fail(f"redis-server did not answer over TLS in {_START_TIMEOUT_S} s:\n{log.read_text()}")


def _no_tls(log: str) -> None:
    if "TLS" in log and ("not supported" in log or "Unrecognized" in log or "Bad directive" in log):
        pytest.skip(f"this redis-server was built without TLS: {log.strip().splitlines()[-1]}")
    pytest.fail(f"redis-server with TLS exited:\n{log}")


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSServer]:
    """A private TLS-only redis-server (client certificates optional) for this module."""
    binary, openssl = shutil.which("redis-server"), shutil.which("openssl")
    if binary is None or openssl is None:
        pytest.fail("the TLS store tests need redis-server and openssl on PATH")
    workdir = tmp_path_factory.mktemp("redis-tls")
    _make_certs(workdir)
    server = TLSServer(free_port(), workdir)
    argv = [binary, "--port", "0", "--tls-port", str(server.port), "--bind", "127.0.0.1"]
    argv += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", str(workdir)]
    argv += ["--tls-cert-file", "server.crt", "--tls-key-file", "server.key"]
    argv += ["--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "optional"]
    log = workdir / "redis.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=workdir, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for_tls(server, proc, log)
        yield server
    finally:
        stop_process(proc)


def documented_acl_line() -> str:
    """The `ACL SETUSER ojs-store ...` line of docs/security.md."""
    text = (ROOT / "docs" / "security.md").read_text(encoding="utf-8")
    found = re.search(r"^ACL SETUSER ojs-store .*$", text, re.MULTILINE)
    assert found, "docs/security.md must show the store's ACL SETUSER line"
    return found.group(0)


@pytest.fixture(scope="module")
def acl_user(tls_server: TLSServer) -> str:
    """The documented ACL user, with the test's password instead of the placeholder."""
    line = documented_acl_line().replace(">CHANGE-ME", f">{PASSWORD}")
    with redis.Redis.from_url(tls_server.verified()) as admin:
        admin.execute_command(*line.split())
    return "ojs-store"


def test_a_store_on_a_rediss_url_with_the_ca_round_trips_a_record(tls_server: TLSServer) -> None:
    store = OJSStore.from_url(tls_server.verified(), prefix=f"t{uuid.uuid4().hex[:6]}")

    store.set_pending("job-1", {"reason": "waiting", "queue": "train"})

    assert store.pending()["job-1"]["queue"] == "train"
    store.close()


def test_a_rediss_url_without_the_servers_ca_is_refused(tls_server: TLSServer) -> None:
    store = OJSStore.from_url(tls_server.url(ssl_cert_reqs="required"))

    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        store.live_workers()
    assert store.ping() is False


def test_a_plain_redis_url_gets_no_answer_from_the_tls_port(tls_server: TLSServer) -> None:
    store = OJSStore.from_url(f"redis://127.0.0.1:{tls_server.port}/0")

    assert store.ping() is False


def test_the_documented_acl_user_runs_every_store_operation_over_mutual_tls(
    tls_server: TLSServer, acl_user: str
) -> None:
    certs = tls_server.certs
    url = tls_server.verified(
        acl_user, ssl_certfile=str(certs / "client.crt"), ssl_keyfile=str(certs / "client.key")
    )
    store = OJSStore.from_url(url)  # the default prefix "ojs", as the ACL pattern ~ojs:* expects
    _producer_side(store)
    _checkpoint_side(store)
    _lease_side(store)
    store.forget_worker("w@host")
    assert store.live_workers() == {}
    store.close()


def _producer_side(store: OJSStore) -> None:
    store.advertise("w@host", {"gpu": 1}, {"gpu_count": 1}, ttl_s=5)
    store.set_held("w@host", [{"task_id": "job-1"}])
    store.set_pending("job-1", {"reason": "waiting"})
    assert store.classes() == {}
    assert list(store.live_workers()) == ["w@host"]
    assert store.held() == {"w@host": [{"task_id": "job-1"}]}
    assert list(store.pending()) == ["job-1"]
    store.clear_pending("job-1")


def _checkpoint_side(store: OJSStore) -> None:
    for n in (1, 2, 3):  # max_count 2: the third commit retires the first
        key = f"s3://b/ckpt/job-1/{n}/"
        meta = CheckpointMeta(job_id="job-1", epoch=n, sequence=n, storage_key=key)
        records.commit(store, meta, max_count=2, lease_token="tok")
    assert records.next_sequence(store, "job-1") >= 4
    [(raw, _)] = records.expired(store, "job-1")
    records.forget_expired(store, "job-1", raw)
    request_preemption(store, "job-1", grace_s=5)
    assert preemption_requested(store, "job-1") is True
    clear_preemption(store, "job-1")
    dead_letter(store, {"task_id": "job-1", "name": "ml.train"}, "crashed 3 times")
    assert [d["last_checkpoint"]["epoch"] for d in dead_jobs(store)] == [3]
    assert [m.epoch for m in records.drop_all(store, "job-1")] == [2, 3]


def _lease_side(store: OJSStore) -> None:
    book = LeaseBook(store, ttl_s=30)
    book.load_scripts()
    token = book.take({"task_id": "job-2", "worker": "w@host"})
    assert book.refresh({"job-2": token}) == ([], [])
    assert [lease["task_id"] for lease in book.all()] == ["job-2"]
    assert book.expired() == []
    assert book.claim("job-2", "v@host", "inc-2", stale_owner="w@host") is not None
    assert book.release("job-2", token) is False  # the claimer holds it now
    assert book._scripts is not None, "the ACL must allow the lease scripts (EVALSHA)"


def test_the_documented_acl_user_cannot_read_keys_outside_the_store_prefix(
    tls_server: TLSServer, acl_user: str
) -> None:
    with redis.Redis.from_url(tls_server.verified()) as admin:
        admin.set("celery-task-meta-x", "result")
    with (
        redis.Redis.from_url(tls_server.verified(acl_user)) as client,
        pytest.raises(redis.exceptions.NoPermissionError),
    ):
        client.get("celery-task-meta-x")
