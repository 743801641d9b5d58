"""The demo's expected outcome, written down by hand from the examples and the profiles.

It is the tests' oracle: where each job may run and how many GPUs it takes.
`test_jobs.py` checks that it agrees with §11 matching, so a change to the
examples, the profiles or the matcher shows up as a disagreement there.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

ALL = frozenset({"a100@demo", "l4@demo", "cpu@demo"})
A100, L4, NOWHERE = frozenset({"a100@demo"}), frozenset({"l4@demo"}), frozenset[str]()

# label -> (nodes that may run it, GPUs it takes)
EXPECTED: dict[str, tuple[frozenset[str], int]] = {
    "§13.1 llm-inference-job": (A100, 2),
    "§13.2 large-scale-training-job": (NOWHERE, 8),
    "§13.3 tpu-training-job": (NOWHERE, 0),
    "§13.4 cost-optimized-hyperparameter-sweep": (A100, 4),
    "§13.5 cpu-only-inference-job": (ALL, 0),
    "§12.1 chain 1/4": (frozenset({"a100@demo", "cpu@demo"}), 0),  # 16 cores: not the L4 node
    "§12.1 chain 2/4": (A100, 8),  # 8x NVLink, asked of an H100 node in the spec
    "§12.1 chain 3/4": (A100, 2),
    "§12.1 chain 4/4": (ALL, 0),
    "§12.2 group 1/3": (A100, 4),
    "§12.2 group 2/3": (L4, 1),
    "§12.2 group 3/3": (L4, 1),  # asked of a T4 in the spec
    "zz-impossible-16x-b200": (NOWHERE, 16),
}
CHAIN = ["§12.1 chain 1/4", "§12.1 chain 2/4", "§12.1 chain 3/4", "§12.1 chain 4/4"]


def check_report(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Assert everything the demo must show; return the jobs by label."""
    assert report["ok"] is True, report["problems"]
    assert report["problems"] == []
    jobs = {j["label"]: j for j in report["jobs"]}
    assert set(jobs) == set(EXPECTED)
    for label, (nodes, gpus) in EXPECTED.items():
        job = jobs[label]
        if not nodes:
            assert job["state"] == "waiting", job
            assert job["reason"].startswith("0/3 workers eligible: "), job
            continue
        assert job["state"] == "done", job
        assert job["node"] in nodes, job
        assert len(job["devices"]) == gpus, job
    impossible = jobs["zz-impossible-16x-b200"]["reason"]
    assert "gpu_type nvidia-a100 not in [nvidia-b200]" in impossible
    assert "gpu_count 8 < 16" in impossible
    assert "accelerator gpu != tpu" in jobs["§13.3 tpu-training-job"]["reason"]
    for before, after in pairwise(CHAIN):
        assert jobs[after]["started"] >= jobs[before]["finished"], (before, after)
    assert not _shared_gpus(list(jobs.values()))
    return jobs


def _shared_gpus(jobs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    ran = [j for j in jobs if j["state"] == "done" and j["devices"]]
    clashes = []
    for i, a in enumerate(ran):
        for b in ran[i + 1 :]:
            same_time = a["started"] < b["finished"] and b["started"] < a["finished"]
            if a["node"] == b["node"] and same_time and set(a["devices"]) & set(b["devices"]):
                clashes.append((a["label"], b["label"]))
    return clashes
