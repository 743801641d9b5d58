"""Tests for `celery_ojs_ml.matching.filters`: the hard constraints, FITS/WAIT/NEVER.

Each table row is one job against one worker (and, where it matters, what the
worker has free now); the row asserts the verdict and the exact reason
messages users see. A row that covers a MUST names its spec section in its id.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching import FreeCapacity, Verdict, describe, match, rule_holds
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import AffinityRule, MLRequirements
from celery_ojs_ml.testing.builders import worker_with

FITS, WAIT, NEVER = Verdict.FITS, Verdict.WAIT, Verdict.NEVER

CPU = worker_with()
A100_40 = worker_with(gpus=4, gpu_type="nvidia-a100", memory_gb=40)
A100_80_NVLINK = worker_with(gpus=8, gpu_type="nvidia-a100", memory_gb=80, interconnect="nvlink")
H100 = worker_with(gpus=8, gpu_type="nvidia-h100", interconnect="nvlink")
B200 = worker_with(gpus=8, gpu_type="nvidia-b200")
T4 = worker_with(gpus=1, gpu_type="nvidia-t4")
TPU_V5E = worker_with(tpu={"type": "v5e", "topology": "4x4"})


def job(**attrs: Any) -> MLRequirements:
    """Canonical requirements from attributes named without their `ext_ml_` prefix."""
    return normalize({f"ext_ml_{k}": v for k, v in attrs.items()}).requirements


def outcome(
    req: MLRequirements, worker: Capabilities, free: FreeCapacity | None = None
) -> tuple[Verdict, list[str]]:
    result = match(req, worker, free)
    return result.verdict, [r.message for r in result.reasons]


Case = tuple[MLRequirements, Capabilities, FreeCapacity | None, Verdict, list[str]]


def table(rows: dict[str, Case]) -> pytest.MarkDecorator:
    return pytest.mark.parametrize(
        ("req", "worker", "free", "verdict", "messages"), list(rows.values()), ids=list(rows)
    )


ACCELERATOR: dict[str, Case] = {
    "a gpu job never fits a cpu-only worker (§3.1 MUST NOT)": (
        job(accelerator="gpu"),
        CPU,
        None,
        NEVER,
        ["accelerator cpu != gpu"],
    ),
    "a job inferred to need a gpu from its gpu type never fits a cpu-only worker (§3.1)": (
        job(gpu_type="nvidia-a100"),
        CPU,
        None,
        NEVER,
        ["accelerator cpu != gpu"],
    ),
    "a tpu job never fits a cpu-only worker (§3.1 MUST NOT)": (
        job(tpu_type="v5e"),
        CPU,
        None,
        NEVER,
        ["accelerator cpu != tpu"],
    ),
    "a tpu job never fits a gpu worker": (
        job(tpu_type="v5e"),
        A100_40,
        None,
        NEVER,
        ["accelerator gpu != tpu"],
    ),
    "a gpu job never fits a tpu worker": (
        job(gpu_count=1),
        TPU_V5E,
        None,
        NEVER,
        ["accelerator tpu != gpu"],
    ),
    "an fpga job never fits a cpu-only worker": (
        job(accelerator="fpga"),
        CPU,
        None,
        NEVER,
        ["accelerator cpu != fpga"],
    ),
    "a cpu job fits a gpu worker": (job(accelerator="cpu"), A100_40, None, FITS, []),
    "a job with no accelerator fits a cpu-only worker": (job(), CPU, None, FITS, []),
}


@table(ACCELERATOR)
def test_accelerator(
    req: MLRequirements,
    worker: Capabilities,
    free: FreeCapacity | None,
    verdict: Verdict,
    messages: list[str],
) -> None:
    assert outcome(req, worker, free) == (verdict, messages)


GPU: dict[str, Case] = {
    "a job asking for 8 gpus never fits a 4 gpu worker (§11 hard constraint)": (
        job(gpu_count=8),
        A100_40,
        None,
        NEVER,
        ["gpu_count 4 < 8"],
    ),
    "a job asking for 4 gpus fits a 4 gpu worker": (job(gpu_count=4), A100_40, None, FITS, []),
    "a job asking for an a100 never fits a t4 worker (§3.2, §11 hard constraint)": (
        job(gpu_type="nvidia-a100"),
        T4,
        None,
        NEVER,
        ["gpu_type nvidia-t4 not in [nvidia-a100]"],
    ),
    "a job asking for 80 GB of VRAM never fits a 40 GB a100 (§3.2 MUST)": (
        job(gpu_memory_gb=80),
        A100_40,
        None,
        NEVER,
        ["gpu_memory_gb 40 < 80"],
    ),
    "an a100 of undeclared size counts as 40 GB, so an 80 GB job never fits it (§3.2 MUST)": (
        job(gpu_memory_gb=80),
        worker_with(gpus=1, gpu_type="nvidia-a100"),
        None,
        NEVER,
        ["gpu_memory_gb 40 < 80"],
    ),
    "a job asking for exactly the worker's VRAM fits it (§3.2 at least)": (
        job(gpu_memory_gb=80),
        A100_80_NVLINK,
        None,
        FITS,
        [],
    ),
    "compute capability 10.0 meets 9.0 as a version, not as text (§3.2 MUST)": (
        job(gpu_compute_capability="9.0"),
        B200,
        None,
        FITS,
        [],
    ),
    "a job needing compute capability 10.0 never fits an h100 at 9.0 (§3.2 MUST)": (
        job(gpu_compute_capability="10.0"),
        H100,
        None,
        NEVER,
        ["compute_capability 9.0 < 10.0"],
    ),
    "a gpu of unknown compute capability never meets a minimum (§3.2 MUST)": (
        job(gpu_compute_capability="8.0"),
        worker_with(gpus=1, gpu_type=None),
        None,
        NEVER,
        ["compute_capability unknown < 8.0"],
    ),
    "a 4 gpu nvlink job never fits a pcie worker (§3.2)": (
        job(gpu_count=4, gpu_interconnect="nvlink"),
        worker_with(gpus=4, interconnect="pcie"),
        None,
        NEVER,
        ["gpu_interconnect pcie != nvlink"],
    ),
    "a 4 gpu nvlink job never fits a worker whose interconnect is unknown": (
        job(gpu_count=4, gpu_interconnect="nvlink"),
        A100_40,
        None,
        NEVER,
        ["gpu_interconnect unknown != nvlink"],
    ),
    "a 4 gpu nvlink job fits an nvlink worker": (
        job(gpu_count=4, gpu_interconnect="nvlink"),
        A100_80_NVLINK,
        None,
        FITS,
        [],
    ),
    "the interconnect of a 1 gpu job is ignored (§3.2 SHOULD)": (
        job(gpu_count=1, gpu_interconnect="nvlink"),
        worker_with(gpus=1, interconnect="pcie"),
        None,
        FITS,
        [],
    ),
    "the filter itself ignores an interconnect left on a 1 gpu requirement": (
        MLRequirements(ext_ml_gpu_count=1, ext_ml_gpu_interconnect="nvlink"),
        worker_with(gpus=1, interconnect="pcie"),
        None,
        FITS,
        [],
    ),
    "a job failing type, VRAM and count lists every reason": (
        job(gpu_type="nvidia-h100", gpu_memory_gb=80, gpu_count=8),
        A100_40,
        None,
        NEVER,
        ["gpu_type nvidia-a100 not in [nvidia-h100]", "gpu_memory_gb 40 < 80", "gpu_count 4 < 8"],
    ),
}


@table(GPU)
def test_gpu(
    req: MLRequirements,
    worker: Capabilities,
    free: FreeCapacity | None,
    verdict: Verdict,
    messages: list[str],
) -> None:
    assert outcome(req, worker, free) == (verdict, messages)


TPU: dict[str, Case] = {
    "a v5p job never fits a v5e worker (§3.3, §11 hard constraint)": (
        job(tpu_type="v5p"),
        TPU_V5E,
        None,
        NEVER,
        ["tpu_type v5e not in [v5p]"],
    ),
    "a 2x4 slice fits a 4x4 worker (§3.3)": (
        job(tpu_type="v5e", tpu_topology="2x4"),
        TPU_V5E,
        None,
        FITS,
        [],
    ),
    "a 4x2 slice fits a 4x4 worker in either orientation": (
        job(tpu_type="v5e", tpu_topology="4x2"),
        TPU_V5E,
        None,
        FITS,
        [],
    ),
    "an 8x8 slice never fits a 4x4 worker (§3.3 MUST)": (
        job(tpu_type="v5e", tpu_topology="8x8"),
        TPU_V5E,
        None,
        NEVER,
        ["tpu_topology 4x4 cannot hold 8x8", "tpu_chip_count 16 < 64"],
    ),
    "a 3-d slice never fits a 2-d worker topology (§3.3 MUST)": (
        job(tpu_type="v5e", tpu_topology="2x2x2"),
        TPU_V5E,
        None,
        NEVER,
        ["tpu_topology 4x4 cannot hold 2x2x2"],
    ),
    "a slice never fits a worker of unknown topology (§3.3 MUST)": (
        job(tpu_type="v5e", tpu_topology="2x2"),
        worker_with(tpu={"type": "v5e", "chip_count": 8}),
        None,
        NEVER,
        ["tpu_topology unknown cannot hold 2x2"],
    ),
    "a job asking for 32 chips never fits a 16 chip worker": (
        job(tpu_type="v5e", tpu_chip_count=32),
        TPU_V5E,
        None,
        NEVER,
        ["tpu_chip_count 16 < 32"],
    ),
    "a job asking for 8 chips waits while only 4 are free": (
        job(tpu_type="v5e", tpu_chip_count=8),
        TPU_V5E,
        FreeCapacity(tpu_chips=4),
        WAIT,
        ["tpu_chip_count free 4 < 8"],
    ),
}


@table(TPU)
def test_tpu(
    req: MLRequirements,
    worker: Capabilities,
    free: FreeCapacity | None,
    verdict: Verdict,
    messages: list[str],
) -> None:
    assert outcome(req, worker, free) == (verdict, messages)


HOST: dict[str, Case] = {
    "a job asking for 64 cores never fits a 32 core worker (§3.5)": (
        job(cpu_cores=64),
        CPU,
        None,
        NEVER,
        ["cpu_cores 32 < 64"],
    ),
    "a job asking for 16 cores waits while only 8 are free (§3.5)": (
        job(cpu_cores=16),
        CPU,
        FreeCapacity(cpu_cores=8),
        WAIT,
        ["cpu_cores free 8 < 16"],
    ),
    "a job asking for 16 cores fits when exactly 16 are free": (
        job(cpu_cores=16),
        CPU,
        FreeCapacity(cpu_cores=16),
        FITS,
        [],
    ),
    "a job asking for more than the total never fits, however much is free": (
        job(cpu_cores=64),
        CPU,
        FreeCapacity(cpu_cores=8),
        NEVER,
        ["cpu_cores 32 < 64"],
    ),
    "a job asking for 512 GB of memory never fits a 256 GB worker (§3.4)": (
        job(memory_gb=512),
        CPU,
        None,
        NEVER,
        ["memory_gb 256 < 512"],
    ),
    "a job asking for 100 GB of memory waits while 64.5 GB are free (§3.4)": (
        job(memory_gb=100),
        CPU,
        FreeCapacity(memory_gb=64.5),
        WAIT,
        ["memory_gb free 64.5 < 100"],
    ),
    "a job asking for 4 gpus waits while 2 of 8 are free": (
        job(gpu_count=4),
        A100_80_NVLINK,
        FreeCapacity(gpus=2),
        WAIT,
        ["gpu_count free 2 < 4"],
    ),
    "a resource the worker does not track never makes a job wait": (
        job(gpu_count=4, cpu_cores=16, memory_gb=100),
        A100_80_NVLINK,
        FreeCapacity(gpus=None, cpu_cores=None, memory_gb=None),
        FITS,
        [],
    ),
    "waiting on gpus and cores lists both reasons": (
        job(gpu_count=4, cpu_cores=16),
        A100_80_NVLINK,
        FreeCapacity(gpus=1, cpu_cores=4),
        WAIT,
        ["gpu_count free 1 < 4", "cpu_cores free 4 < 16"],
    ),
    "a job asking for 500 GB of storage never fits a 100 GB worker (v0.1 §6.2 MUST)": (
        job(storage_gb=500),
        worker_with(storage_gb=100),
        None,
        NEVER,
        ["storage_gb 100 < 500"],
    ),
    "a job asking for storage never fits a worker that does not advertise any (v0.1 §6.2)": (
        job(storage_gb=500),
        CPU,
        None,
        NEVER,
        ["storage_gb unknown < 500"],
    ),
    "a job asking for 64 GB of shm never fits a worker with 16 GB (§3.4, v0.1 §6.2 MUST)": (
        job(shm_size_gb=64),
        worker_with(shm_size_gb=16),
        None,
        NEVER,
        ["shm_size_gb 16 < 64"],
    ),
    "storage and shm are minimums that running work does not consume": (
        job(storage_gb=100, shm_size_gb=16),
        worker_with(storage_gb=100, shm_size_gb=16),
        FreeCapacity(cpu_cores=1, memory_gb=1),
        FITS,
        [],
    ),
}


@table(HOST)
def test_host_resources(
    req: MLRequirements,
    worker: Capabilities,
    free: FreeCapacity | None,
    verdict: Verdict,
    messages: list[str],
) -> None:
    assert outcome(req, worker, free) == (verdict, messages)


EAST = worker_with(gpus=1, labels={"region": "us-east-1", "zone": "us-east-1a"})

SELECTOR: dict[str, Case] = {
    "a worker matching every selector label fits (§7.1 MUST match ALL)": (
        job(node_selector={"region": "us-east-1", "zone": "us-east-1a"}),
        EAST,
        None,
        FITS,
        [],
    ),
    "a worker matching one of two selector labels never fits (§7.1 MUST match ALL)": (
        job(node_selector={"region": "us-east-1", "zone": "us-east-1b"}),
        EAST,
        None,
        NEVER,
        ["zone us-east-1a != us-east-1b"],
    ),
    "a worker without a selector label never fits (§7.1 MUST)": (
        job(node_selector={"cluster": "ml-prod"}),
        EAST,
        None,
        NEVER,
        ["cluster <unset> != ml-prod"],
    ),
    "a selector matches labels derived from the hardware (§7.1)": (
        job(node_selector={"gpu_type": "nvidia-a100", "gpu_count": "1"}),
        EAST,
        None,
        FITS,
        [],
    ),
    "an own label cannot make an a100 worker match an h100 selector (§7.1)": (
        job(node_selector={"gpu_type": "nvidia-h100"}),
        worker_with(gpus=1, labels={"gpu_type": "nvidia-h100"}),
        None,
        NEVER,
        ["gpu_type nvidia-a100 != nvidia-h100"],
    ),
}


@table(SELECTOR)
def test_node_selector(
    req: MLRequirements,
    worker: Capabilities,
    free: FreeCapacity | None,
    verdict: Verdict,
    messages: list[str],
) -> None:
    assert outcome(req, worker, free) == (verdict, messages)


def rule(key: str, operator: str, *values: str) -> AffinityRule:
    return AffinityRule.model_validate({"key": key, "operator": operator, "values": values})


OPERATORS: dict[str, tuple[AffinityRule, dict[str, str], bool]] = {
    "In holds when the label is one of the values (§7.2)": (
        rule("gpu_type", "In", "nvidia-a100", "nvidia-h100"),
        {"gpu_type": "nvidia-h100"},
        True,
    ),
    "In fails when the label is another value (§7.2)": (
        rule("gpu_type", "In", "nvidia-a100"),
        {"gpu_type": "nvidia-t4"},
        False,
    ),
    "In fails when the label is missing (§7.2)": (rule("gpu_type", "In", "nvidia-a100"), {}, False),
    "NotIn holds when the label is another value (§7.2)": (
        rule("region", "NotIn", "eu-west-1"),
        {"region": "us-east-1"},
        True,
    ),
    "NotIn fails when the label is one of the values (§7.2)": (
        rule("region", "NotIn", "eu-west-1"),
        {"region": "eu-west-1"},
        False,
    ),
    "NotIn holds when the label is missing (§7.2)": (
        rule("region", "NotIn", "eu-west-1"),
        {},
        True,
    ),
    "Exists holds whatever the label's value (§7.2)": (
        rule("spot", "Exists"),
        {"spot": "false"},
        True,
    ),
    "Exists fails when the label is missing (§7.2)": (rule("spot", "Exists"), {}, False),
    "DoesNotExist holds when the label is missing (§7.2)": (rule("spot", "DoesNotExist"), {}, True),
    "DoesNotExist fails when the label is present (§7.2)": (
        rule("spot", "DoesNotExist"),
        {"spot": "true"},
        False,
    ),
    "Gt compares numbers, so 10 is greater than 9 (§7.2)": (
        rule("gpu_count", "Gt", "9"),
        {"gpu_count": "10"},
        True,
    ),
    "Gt fails on equal numbers (§7.2)": (rule("gpu_count", "Gt", "8"), {"gpu_count": "8"}, False),
    "Gte holds on equal numbers (§7.2)": (
        rule("gpu_memory_gb", "Gte", "80"),
        {"gpu_memory_gb": "80"},
        True,
    ),
    "Gte fails on a smaller number (§7.2)": (
        rule("gpu_memory_gb", "Gte", "80"),
        {"gpu_memory_gb": "40"},
        False,
    ),
    "Lt compares numbers, so 9 is less than 10 (§7.2)": (
        rule("gpu_count", "Lt", "10"),
        {"gpu_count": "9"},
        True,
    ),
    "Lt fails on equal numbers (§7.2)": (rule("gpu_count", "Lt", "8"), {"gpu_count": "8"}, False),
    "Lte holds on equal decimals (§7.2)": (
        rule("memory_gb", "Lte", "64.5"),
        {"memory_gb": "64.5"},
        True,
    ),
    "Lte fails on a larger number (§7.2)": (
        rule("memory_gb", "Lte", "64"),
        {"memory_gb": "64.5"},
        False,
    ),
    "compute capability 10.0 is greater than 9.0 as a version (§7.2, §3.2)": (
        rule("compute_capability", "Gt", "9.0"),
        {"compute_capability": "10.0"},
        True,
    ),
    "compute capability 7.10 is greater than 7.9 as a version, not as a decimal": (
        rule("compute_capability", "Gte", "7.9"),
        {"compute_capability": "7.10"},
        True,
    ),
    "compute capability 8.9 is less than 10.0 as a version": (
        rule("compute_capability", "Lt", "10.0"),
        {"compute_capability": "8.9"},
        True,
    ),
    "a numeric operator fails on a label that is not a number": (
        rule("gpu_count", "Gt", "1"),
        {"gpu_count": "many"},
        False,
    ),
    "a numeric operator fails on a missing label": (rule("gpu_count", "Gte", "1"), {}, False),
}


@pytest.mark.parametrize(
    ("affinity_rule", "labels", "holds"), list(OPERATORS.values()), ids=list(OPERATORS)
)
def test_rule_holds(affinity_rule: AffinityRule, labels: dict[str, str], holds: bool) -> None:
    assert rule_holds(affinity_rule, labels) is holds


DESCRIBED: dict[str, tuple[AffinityRule, str]] = {
    "a rule with values reads as key, operator and sorted values": (
        rule("gpu_type", "In", "nvidia-h100", "nvidia-a100"),
        "gpu_type In [nvidia-a100, nvidia-h100]",
    ),
    "a rule without values reads as key and operator": (
        rule("spot", "DoesNotExist"),
        "spot DoesNotExist",
    ),
}


@pytest.mark.parametrize(("affinity_rule", "text"), list(DESCRIBED.values()), ids=list(DESCRIBED))
def test_describe(affinity_rule: AffinityRule, text: str) -> None:
    assert describe(affinity_rule) == text


def required(*rules: dict[str, Any]) -> dict[str, Any]:
    return {"required": list(rules)}


AFFINITY: dict[str, Case] = {
    "a t4 worker never fits a job requiring an a100 or h100 (§7.2 MUST NOT)": (
        job(affinity=required({"key": "gpu_type", "operator": "In", "values": ["nvidia-a100"]})),
        T4,
        None,
        NEVER,
        ["gpu_type nvidia-t4 fails gpu_type In [nvidia-a100]"],
    ),
    "a worker without the label never fits a Gte rule (§7.2 MUST NOT)": (
        job(affinity=required({"key": "tier", "operator": "Gte", "values": ["2"]})),
        CPU,
        None,
        NEVER,
        ["tier <unset> fails tier Gte [2]"],
    ),
    "a worker must satisfy every required rule (§7.2 MUST NOT)": (
        job(
            affinity=required(
                {"key": "region", "operator": "In", "values": ["us-east-1"]},
                {"key": "spot", "operator": "DoesNotExist"},
            )
        ),
        worker_with(labels={"region": "us-east-1", "spot": "true"}),
        None,
        NEVER,
        ["spot true fails spot DoesNotExist"],
    ),
    "a b200 worker fits a job requiring compute capability above 9.0 (§7.2)": (
        job(affinity=required({"key": "compute_capability", "operator": "Gt", "values": ["9.0"]})),
        B200,
        None,
        FITS,
        [],
    ),
    "a worker without a label fits a NotIn rule on it (§7.2)": (
        job(affinity=required({"key": "region", "operator": "NotIn", "values": ["eu-west-1"]})),
        CPU,
        None,
        FITS,
        [],
    ),
    "preferred rules that no worker satisfies never block dispatch (§7.2 MUST NOT)": (
        job(
            affinity={
                "preferred": [
                    {"key": "region", "operator": "In", "values": ["eu-west-1"], "weight": 100}
                ]
            }
        ),
        CPU,
        None,
        FITS,
        [],
    ),
}


@table(AFFINITY)
def test_required_affinity(
    req: MLRequirements,
    worker: Capabilities,
    free: FreeCapacity | None,
    verdict: Verdict,
    messages: list[str],
) -> None:
    assert outcome(req, worker, free) == (verdict, messages)


LARGE_TRAIN = {"job_type": "ml.train.large"}
AVOID_LARGE_TRAIN = job(
    anti_affinity=required({"key": "job_type", "operator": "In", "values": ["ml.train.large"]})
)

ANTI_AFFINITY: dict[str, Case] = {
    "an anti-affinity rule that holds on the worker's labels never fits (§7.3)": (
        AVOID_LARGE_TRAIN,
        worker_with(labels=LARGE_TRAIN),
        None,
        NEVER,
        ["anti-affinity job_type In [ml.train.large] holds on the worker"],
    ),
    "an anti-affinity rule that holds on a running job waits for it (§7.3)": (
        AVOID_LARGE_TRAIN,
        CPU,
        FreeCapacity(running_labels=({"job_type": "ml.eval"}, LARGE_TRAIN)),
        WAIT,
        ["anti-affinity job_type In [ml.train.large] holds on a running job"],
    ),
    "an anti-affinity rule that holds on no running job fits (§7.3)": (
        AVOID_LARGE_TRAIN,
        CPU,
        FreeCapacity(running_labels=({"job_type": "ml.eval"},)),
        FITS,
        [],
    ),
    "an anti-affinity NotIn rule does not hold on a worker without the label": (
        job(anti_affinity=required({"key": "job_type", "operator": "NotIn", "values": ["x"]})),
        CPU,
        FreeCapacity(running_labels=({},)),
        FITS,
        [],
    ),
}


@table(ANTI_AFFINITY)
def test_anti_affinity(
    req: MLRequirements,
    worker: Capabilities,
    free: FreeCapacity | None,
    verdict: Verdict,
    messages: list[str],
) -> None:
    assert outcome(req, worker, free) == (verdict, messages)


LLAMA_V2 = job(model_id="llama-3.1-70b", model_version="v2.1")

MODEL_AND_RESERVATION: dict[str, Case] = {
    "a pinned model never fits a registry-less worker without it loaded (§4 MUST)": (
        LLAMA_V2,
        worker_with(model_registry_access=False),
        None,
        NEVER,
        ["model llama-3.1-70b@v2.1 not loaded"],
    ),
    "a pinned model never fits a registry-less worker holding another version (§4 MUST)": (
        LLAMA_V2,
        worker_with(model_registry_access=False, models=[("llama-3.1-70b", "v2.0")]),
        None,
        NEVER,
        ["model llama-3.1-70b@v2.1 not loaded"],
    ),
    "a pinned model fits a registry-less worker holding that version (§4 MUST)": (
        LLAMA_V2,
        worker_with(model_registry_access=False, models=[("llama-3.1-70b", "v2.1")]),
        None,
        FITS,
        [],
    ),
    "a pinned model fits a worker that declares registry access (§4 accessible)": (
        LLAMA_V2,
        worker_with(model_registry_access=True),
        None,
        FITS,
        [],
    ),
    "a pinned model never fits a worker that declares nothing, by default (§4 MUST)": (
        LLAMA_V2,
        CPU,
        None,
        NEVER,
        ["model llama-3.1-70b@v2.1 not loaded"],
    ),
    "a model id without a version pins nothing (§4)": (
        job(model_id="llama-3.1-70b"),
        worker_with(model_registry_access=False),
        None,
        FITS,
        [],
    ),
    "a reserved job fits a worker in its reservation pool (§8.3)": (
        job(reservation_id="res-1"),
        worker_with(labels={"reservation_id": "res-1"}),
        None,
        FITS,
        [],
    ),
    "a reserved job never fits a worker outside any reservation (§8.3 MUST NOT)": (
        job(reservation_id="res-1"),
        CPU,
        None,
        NEVER,
        ["reservation_id <unset> != res-1"],
    ),
    "a reserved job never fits a worker in another reservation (§8.3 MUST NOT)": (
        job(reservation_id="res-1"),
        worker_with(labels={"reservation_id": "res-2"}),
        None,
        NEVER,
        ["reservation_id res-2 != res-1"],
    ),
}


@table(MODEL_AND_RESERVATION)
def test_model_version_and_reservation(
    req: MLRequirements,
    worker: Capabilities,
    free: FreeCapacity | None,
    verdict: Verdict,
    messages: list[str],
) -> None:
    assert outcome(req, worker, free) == (verdict, messages)


STRUCTURED: dict[str, tuple[MLRequirements, Capabilities, FreeCapacity | None, dict[str, Any]]] = {
    "a NEVER reason reports the total as both available and capacity": (
        job(gpu_memory_gb=80),
        A100_40,
        None,
        {
            "resource": "gpu_memory_gb",
            "requested": 80.0,
            "available": 40.0,
            "capacity": 40.0,
            "verdict": "NEVER",
            "message": "gpu_memory_gb 40 < 80",
        },
    ),
    "a count over the total reports what is free as available": (
        job(gpu_count=16),
        A100_80_NVLINK,
        FreeCapacity(gpus=3),
        {
            "resource": "gpu_count",
            "requested": 16,
            "available": 3,
            "capacity": 8,
            "verdict": "NEVER",
            "message": "gpu_count 8 < 16",
        },
    ),
    "a WAIT reason reports what is free and the total": (
        job(gpu_count=4),
        A100_80_NVLINK,
        FreeCapacity(gpus=2),
        {
            "resource": "gpu_count",
            "requested": 4,
            "available": 2,
            "capacity": 8,
            "verdict": "WAIT",
            "message": "gpu_count free 2 < 4",
        },
    ),
    "a label reason names the label as its resource": (
        job(node_selector={"region": "eu-west-1"}),
        EAST,
        None,
        {
            "resource": "label:region",
            "requested": "eu-west-1",
            "available": "us-east-1",
            "capacity": "us-east-1",
            "verdict": "NEVER",
            "message": "region us-east-1 != eu-west-1",
        },
    ),
}


@pytest.mark.parametrize(
    ("req", "worker", "free", "reason"), list(STRUCTURED.values()), ids=list(STRUCTURED)
)
def test_reasons_are_structured(
    req: MLRequirements, worker: Capabilities, free: FreeCapacity | None, reason: dict[str, Any]
) -> None:
    assert [r.as_dict() for r in match(req, worker, free).reasons] == [reason]
