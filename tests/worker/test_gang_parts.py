"""Gang parts without a broker: Flux node>slot becomes a gang, the rendezvous environment,
and the bounds on a gang's size (Flux RFC 25 node>slot)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery import Celery

from celery_ojs_ml import OJSML
from celery_ojs_ml.child.gang_env import env_of, restore_env, set_env
from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.leader.gangs import master_port
from celery_ojs_ml.spec.documents import load_text
from celery_ojs_ml.wire.gangs import gang_headers
from celery_ojs_ml.worker.gangs import stop_rank
from celery_ojs_ml.worker.running import Running

ROOT = Path(__file__).resolve().parents[2]


def test_a_flux_node_slot_jobspec_over_two_nodes_is_submitted_as_a_two_rank_gang() -> None:
    app = Celery("t", broker="memory://", set_as_current=False)
    app.conf.ojs_ml_store_url = "redis://127.0.0.1:1/0"  # never contacted: no publish here
    ml = OJSML(app)
    text = (ROOT / "examples/jobs/flux-rfc25-example.yaml").read_text()
    sig = ml.signature_for(load_text(text, name="flux"))
    ranks = [t.options["headers"]["ojs_gang"] for t in sig.tasks]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["size"] for r in ranks} == {2} and len({r["id"] for r in ranks}) == 1
    assert all(t.options["headers"]["ext_ml_gpu_count"] == 1 for t in sig.tasks)


@pytest.mark.parametrize("size", [0, 1, True, "2", 10_000])
def test_a_gang_size_outside_2_to_1024_is_a_spec_error_naming_size(size: object) -> None:
    with pytest.raises(SpecError) as found:
        gang_headers(size)
    assert found.value.paths == ["size"]


def test_a_rank_runs_with_the_env_rendezvous_and_the_environment_is_restored_after() -> None:
    rdv = {"master_addr": "10.0.0.7", "master_port": 29555, "world_size": 4, "rank": 3}
    request = SimpleNamespace(ojs_rendezvous=rdv)
    os.environ["RANK"] = "keep"
    os.environ.pop("MASTER_ADDR", None)
    set_env(request)
    seen = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    restore_env(request)
    assert seen == {"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29555", "WORLD_SIZE": "4",
                    "RANK": "3"}  # fmt: skip
    assert os.environ.get("RANK") == "keep" and "MASTER_ADDR" not in os.environ
    os.environ.pop("RANK")


def test_a_malformed_rendezvous_header_sets_nothing() -> None:
    assert env_of({"master_addr": "x"}) == {}
    assert env_of("garbage") == {}


def test_a_master_port_is_never_one_the_kernel_gives_outgoing_connections() -> None:
    """A port from the ephemeral range may be the local end of any connection on rank 0's
    host (a Redis client's, say): torch's store then fails to listen (EADDRINUSE) and the
    gang is placed again. Linux's default range starts at 32768; this host's is read too."""
    low, high = 32768, 60999
    found = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if found.exists():
        low, high = (int(p) for p in found.read_text().split())
    drawn = {master_port() for _ in range(5000)}
    assert all(29500 <= p < 32768 for p in drawn), sorted(drawn)[-3:]
    assert not [p for p in drawn if low <= p <= high], f"ephemeral range {low}-{high}"
    assert len(drawn) > 1000, "drawn afresh, not one fixed port"


class _Request:
    """A running rank's request (hashable, as Celery's are)."""

    def __init__(self, placement: str, pid: int | None) -> None:
        self.id, self.worker_pid = "t1", pid
        rdv = {"gang": "gang-x", "placement": placement, "rank": 1, "world_size": 2}
        self.request_dict = {"ojs_rendezvous": rdv}


class _Gate:
    """What `stop_rank` reads of a worker: its running requests, `stopping`, `stop_child`."""

    def __init__(self, req: _Request) -> None:
        self.running = Running()
        self.running.requests[req.id] = req
        self.stopping = self.running.stopping
        self.killed: list[int] = []

    def stop_child(self, req: _Request) -> None:
        assert req.worker_pid is not None
        self.killed.append(req.worker_pid)


def _rank(placement: str, pid: int | None = 4242) -> _Request:
    return _Request(placement, pid)


def test_a_stop_for_a_rank_kills_its_child_only_when_it_runs_for_that_placement() -> None:
    req = _rank("p-new")
    gate = _Gate(req)
    assert not stop_rank(gate.running, gate.stop_child, "t1", "p-old"), (
        "a later placement of the same id is left alone"
    )
    assert gate.killed == [] and gate.stopping == set()
    assert not stop_rank(gate.running, gate.stop_child, "other", "p-new")
    assert stop_rank(gate.running, gate.stop_child, "t1", "p-new")
    assert gate.killed == [4242] and req in gate.stopping, "its failure re-places it"
