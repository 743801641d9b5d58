"""The Alibaba GPU trace (2023, "openb") as plain values for `bench/replay.py`.

Nodes and pods are read from the CSV files in `../shared/traces/alibaba-gpu-v2023`
(or `OJS_TRACE_DIR`), unchanged. Units stay the trace's own: CPU in milli-cores,
memory in MiB, GPU in milli-GPU (1000 = one whole GPU), times in seconds.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE.parent.parent / "shared" / "traces" / "alibaba-gpu-v2023"
WORKLOADS = {
    "default": "openb_pod_list_default.csv",
    "gpuspec33": "openb_pod_list_gpuspec33.csv",
    "multigpu50": "openb_pod_list_multigpu50.csv",
}
NODES = "openb_node_list_gpu_node.csv"


@dataclass(frozen=True, slots=True)
class Node:
    """One GPU node of the trace."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class Pod:
    """One pod of the trace; `gpu_milli` is per GPU, `gpu_spec` the allowed models."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: frozenset[str] = frozenset()
    qos: str = ""
    creation: float = 0.0
    scheduled: float | None = None
    deletion: float | None = None

    @property
    def gpu_total(self) -> int:
        """Milli-GPU the pod takes in all (FGD's measure of arrived load)."""
        return self.num_gpu * self.gpu_milli if self.num_gpu else 0

    @property
    def kind(self) -> tuple[int, int, int, int, frozenset[str]]:
        """What placement depends on: CPU, memory, GPUs, milli per GPU, allowed models."""
        return (self.cpu_milli, self.memory_mib, self.num_gpu, self.gpu_milli, self.gpu_spec)


def trace_dir() -> Path:
    """Where the CSV files are: `OJS_TRACE_DIR`, else the shared copy beside the repo."""
    where = Path(os.environ.get("OJS_TRACE_DIR", DEFAULT_DIR))
    if not (where / NODES).exists():
        raise SystemExit(
            f"trace not found in {where}; set OJS_TRACE_DIR to the folder holding {NODES}"
        )
    return where


def load_nodes(where: Path | None = None) -> list[Node]:
    """The 1,213 GPU nodes, in file order."""
    with open((where or trace_dir()) / NODES, newline="") as fh:
        return [
            Node(r["sn"], int(r["cpu_milli"]), int(r["memory_mib"]), int(r["gpu"]), r["model"])
            for r in csv.DictReader(fh)
        ]


def _time(value: str | None) -> float | None:
    return float(value) if value not in (None, "") else None


def load_pods(workload: str, where: Path | None = None) -> list[Pod]:
    """The pods of one workload file, sorted by creation time (file order on a tie)."""
    with open((where or trace_dir()) / WORKLOADS[workload], newline="") as fh:
        rows = list(csv.DictReader(fh))
    pods = [
        Pod(
            r["name"],
            int(r["cpu_milli"]),
            int(r["memory_mib"]),
            int(r["num_gpu"]),
            int(r["gpu_milli"]) if int(r["num_gpu"]) else 0,
            frozenset(s for s in (r.get("gpu_spec") or "").split("|") if s),
            r.get("qos") or "",
            _time(r.get("creation_time")) or 0.0,
            _time(r.get("scheduled_time")),
            _time(r.get("deletion_time")),
        )
        for r in rows
    ]
    return sorted(pods, key=lambda p: p.creation)
