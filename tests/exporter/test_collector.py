"""`OJSMLCollector` on a real redis-server: the gauges a scrape reads from store records
written by the store's own functions, and how few reads a scrape makes."""

from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid
from typing import Any

import pytest
import redis

from celery_ojs_ml.allocator import Allocator
from celery_ojs_ml.capabilities import capabilities_to_dict, resolve_capabilities
from celery_ojs_ml.exporter import Exporter, OJSMLCollector, metric_names
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.store.deadletter import dead_letter
from celery_ojs_ml.store.leases import LeaseBook
from celery_ojs_ml.store.pending import PendingBook
from celery_ojs_ml.store.registry import OJSStore
from celery_ojs_ml.store.reservations import ReservationBook
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.records import job_record
from tests.helpers import free_port

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(collector: OJSMLCollector) -> Samples:
    """Every sample of one `collect()`: (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }


def _value(found: Samples, name: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


def _run(
    store: OJSStore, worker: str, profile: str, jobs: list[dict[str, Any]], **kw: Any
) -> list[str]:
    """Advertise `worker` running `jobs` (requirements), each with its lease; their ids."""
    caps = resolve_capabilities(f"profile:{profile}")
    allocator = Allocator(caps, **kw)
    ids = []
    for attrs in jobs:
        task_id = f"run-{uuid.uuid4().hex}"
        queue = attrs.pop("queue")
        allocator.try_alloc(task_id, task_id, normalize(attrs).requirements)
        headers = {h.LOGICAL: queue, "ext_ml_gpu_count": attrs.get("ext_ml_gpu_count")}
        LeaseBook(store, 60).take(job_record(task_id, "train", [], {}, headers))
        ids.append(task_id)
    store.advertise(worker, capabilities_to_dict(caps), allocator.snapshot(), ttl_s=60)
    return ids


def _admit(book: PendingBook, band: str, queue: str) -> str:
    task_id = f"wait-{uuid.uuid4().hex}"
    meta = {"task": "train", "queue": queue, "band": band, "gpus": 2, "submitted_at": time.time()}
    assert book.admit(task_id, meta, {"headers": {}, "body": ""})
    return task_id


@pytest.fixture
def fleet(store: OJSStore) -> list[str]:
    """Two workers, three running jobs, three waiting ones, a leader, budgets, dead
    letters and a reservation; every task id."""
    ids = _run(store, "big@t", "nvidia-a100x4", [
        {"ext_ml_gpu_count": 2, "ext_ml_priority_class": "reserved", "queue": "train"},
        {"ext_ml_gpu_count": 1, "ext_ml_priority_class": "spot", "queue": "batch"},
    ])  # fmt: skip
    ids += _run(store, "small@t", "nvidia-l4x1", [{"ext_ml_gpu_count": 1, "queue": "train"}])
    book = PendingBook(store)
    ids += [_admit(book, "spot", "batch"), _admit(book, "spot", "batch")]
    ids.append(_admit(book, "on-demand", "train"))
    assert book.lead("lead@t", 30)
    assert book.lead("lead@t", 30, pass_s=0.25)
    budgets = {
        "train": {"gpus": 3, "max_total_gpus": 8, "jobs": 2, "max_concurrent_gpu_jobs": None}
    }
    store.client.set(store.key("scheduler", "budgets"), json.dumps(budgets))
    for _ in range(2):
        dead_letter(store, job_record(f"dead-{uuid.uuid4().hex}", "train", [], {}, {}), "x")
    ReservationBook(store).create("res-1", {"ext_ml_gpu_count": 2}, None)
    return ids


def test_a_scrape_counts_gpus_jobs_the_leader_budgets_and_reservations_from_the_store(
    store: OJSStore, fleet: list[str]
) -> None:
    found = samples(OJSMLCollector(store))

    gpus = "ojs_ml_gpus"
    assert _value(found, gpus, worker="big@t", gpu_type="nvidia-a100", state="allocated") == 3
    assert _value(found, gpus, worker="big@t", gpu_type="nvidia-a100", state="free") == 1
    assert _value(found, gpus, worker="small@t", gpu_type="nvidia-l4", state="allocated") == 1
    assert _value(found, gpus, worker="small@t", gpu_type="nvidia-l4", state="free") == 0
    jobs = {labels: v for (name, labels), v in found.items() if name == "ojs_ml_jobs"}
    assert jobs == {
        (("band", "reserved"), ("queue", "train"), ("state", "running")): 1,
        (("band", "spot"), ("queue", "batch"), ("state", "running")): 1,
        (("band", "on-demand"), ("queue", "train"), ("state", "running")): 1,
        (("band", "spot"), ("queue", "batch"), ("state", "pending")): 2,
        (("band", "on-demand"), ("queue", "train"), ("state", "pending")): 1,
    }
    assert _value(found, "ojs_ml_workers") == 2
    assert _value(found, "ojs_ml_leader", leader="lead@t") == 1
    assert _value(found, "ojs_ml_scheduler_pass_seconds") == 0.25
    assert _value(found, "ojs_ml_dead_letters") == 2
    assert _value(found, "ojs_ml_budget_gpus", queue="train", state="used") == 3
    assert _value(found, "ojs_ml_budget_gpus", queue="train", state="limit") == 8
    assert _value(found, "ojs_ml_reservations", state="waiting") == 1


def test_no_label_value_is_a_task_id(store: OJSStore, fleet: list[str]) -> None:
    values = {v for _, labels in samples(OJSMLCollector(store)) for _, v in labels}
    assert values.isdisjoint(fleet)


def _calls(client: redis.Redis, command: str) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_a_scrape_reads_only_the_records_of_jobs_new_since_the_last_one(
    store: OJSStore, fleet: list[str]
) -> None:
    collector = OJSMLCollector(store)
    samples(collector)
    before = (_calls(store.client, "hmget"), _calls(store.client, "get"))
    samples(collector)
    # the lock, the budgets and the two heartbeats (in the indexed script); no lease
    assert (_calls(store.client, "hmget"), _calls(store.client, "get")) == (
        before[0],
        before[1] + 4,
    )
    _admit(PendingBook(store), "spot", "batch")
    found = samples(collector)
    assert _calls(store.client, "hmget") == before[0] + 1, "one read: the new job's record"
    assert _value(found, "ojs_ml_jobs", state="pending", band="spot", queue="batch") == 3


def test_a_job_leaves_the_pending_count_when_its_gate_starts_it(
    store: OJSStore, fleet: list[str]
) -> None:
    collector = OJSMLCollector(store)
    samples(collector)
    book = PendingBook(store)
    waiting = fleet[-1]
    token = book.assign(waiting, "big@t", now=time.time())
    assert token is not None and book.start(waiting, token, "big@t") == "ok"
    found = samples(collector)
    assert _value(found, "ojs_ml_jobs", state="pending", band="on-demand", queue="train") is None


def test_a_gpu_sharing_worker_reports_the_vram_of_its_running_shares(store: OJSStore) -> None:
    """Two 20 GB shares on an 80 GB A100 of a 2-GPU worker: 40 of 160 GB."""
    share = {"ojs_ml_gpu_share": True, "ext_ml_gpu_memory_gb": 20, "queue": "infer"}
    _run(store, "share@t", "nvidia-a100x2", [dict(share), dict(share)], gpu_sharing=True)
    found = samples(OJSMLCollector(store))
    assert _value(found, "ojs_ml_gpu_share_bytes", worker="share@t", state="allocated") == 40e9
    assert _value(found, "ojs_ml_gpu_share_bytes", worker="share@t", state="total") == 160e9


def test_a_store_that_does_not_answer_leaves_the_gauges_without_samples() -> None:
    gone = OJSStore.from_url(f"redis://127.0.0.1:{free_port()}/0")
    families = list(OJSMLCollector(gone).collect())
    assert {f.name for f in families if f.type == "gauge" and f.samples} == set()
    assert len(families) == len(metric_names())


def test_every_metric_name_is_in_the_help_lines_of_a_scrape_over_http(store: OJSStore) -> None:
    exporter = Exporter(store, None, port=0)
    port = exporter.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        exporter.stop()
    assert set(re.findall(r"^# HELP (\w+) ", text, flags=re.M)) == metric_names()
