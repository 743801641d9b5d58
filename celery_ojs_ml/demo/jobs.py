"""The demo's fleet and jobs: the specs' example documents, and who may run each job.

The fleet is three simulated nodes (an A100x8 NVLink node, an L4 node and a
CPU-only node). The jobs are the OJS ML Resources v0.3 examples (§13.1-§13.5,
the §12.1 chain, the §12.2 group) plus `zz-impossible-16x-b200.json`.

Key decisions:
* Each job's eligible nodes come from the same `match()` the plugin uses, on the same
  profiles the workers load: an independent check of where the plugin placed each job.
* A job asking for a GPU the fleet lacks is submitted with the nearest one it has,
  only when that makes it runnable (`_fit`); the others must wait with a reason.
* Task ids carry a per-run suffix, so a run never reads an earlier run's results.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery_ojs_ml.capabilities import Capabilities, resolve_capabilities
from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.matching import match
from celery_ojs_ml.spec.classes import band, has_hard_constraints
from celery_ojs_ml.spec.envelope import Job, parse_job
from celery_ojs_ml.spec.workflow import STEP_KEYS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FLEET = {
    "a100@demo": "profile:nvidia-a100x8",
    "l4@demo": "profile:nvidia-l4x1",
    "cpu@demo": "profile:cpu",
}
"""Worker hostname -> `--ojs-ml-capabilities` value."""
FILES = (
    "v03-13.1-llm-inference-job.json",
    "v03-13.2-large-scale-training-job.json",
    "v03-13.3-tpu-training-job.json",
    "v03-13.4-cost-optimized-hyperparameter-sweep.json",
    "v03-13.5-cpu-only-inference-job.json",
    "v03-12.1-training-pipeline-example.json",
    "v03-12.2-multi-model-inference-example.json",
    "zz-impossible-16x-b200.json",
)
SUBSTITUTES = {"nvidia-h100": "nvidia-a100", "nvidia-t4": "nvidia-l4"}
"""GPU models the fleet lacks -> the nearest model it has."""


@dataclass(frozen=True)
class DemoJob:
    """One Celery task the demo submits, and where it may run."""

    task_id: str
    label: str
    task: str
    band: str
    eligible: frozenset[str]
    """Hostnames of the fleet nodes that can ever run it (empty: it must wait)."""
    routed: bool = True
    """False for a job without hard constraints: plain Celery routing, no gate."""
    note: str = ""
    after: str | None = None
    """The task id of the chain step that must finish first."""

    @property
    def runnable(self) -> bool:
        """Whether some node of the fleet can ever run it."""
        return bool(self.eligible)


@dataclass
class Submission:
    """One example document as submitted, and the jobs it becomes."""

    source: str
    doc: dict[str, Any]
    jobs: list[DemoJob] = field(default_factory=list)


REGISTRY_ACCESS = True
"""The demo's workers run with `ojs_ml_model_registry_access` (they can fetch any model
version), so the spec examples pinned to a model version have somewhere to run."""


def fleet_capabilities(fleet: dict[str, str] | None = None) -> dict[str, Capabilities]:
    """Hostname -> capabilities, resolved exactly as each worker resolves them."""
    return {
        host: resolve_capabilities(value).model_copy(
            update={"model_registry_access": REGISTRY_ACCESS}
        )
        for host, value in (fleet or FLEET).items()
    }


def load(
    run_id: str, examples: Path = EXAMPLES, fleet: dict[str, Capabilities] | None = None
) -> list[Submission]:
    """Every demo document, made runnable on the fleet where it can be, with run-unique ids."""
    caps = fleet or fleet_capabilities()
    found = []
    for name in FILES:
        doc = json.loads((examples / "jobs" / name).read_text(encoding="utf-8"))
        found.append(_submission(Path(name).stem, doc, run_id, caps))
    return found


def short_label(stem: str) -> str:
    """`v03-13.1-llm-inference-job` -> `§13.1 llm-inference-job`."""
    parts = stem.split("-", 2)
    if parts[0].startswith("v0") and len(parts) == 3:
        return f"§{parts[1]} {parts[2]}"
    return stem


def _submission(
    stem: str, doc: dict[str, Any], run_id: str, caps: dict[str, Capabilities]
) -> Submission:
    doc = copy.deepcopy(doc)
    label = short_label(stem)
    kind = doc.get("workflow_type")
    if kind is None:
        doc["id"] = f"{doc.get('id') or stem}-{run_id}"
        job, note = _fit(doc, caps)
        return Submission(stem, doc, [_demo_job(doc["id"], label, job, caps, note)])
    items = doc[STEP_KEYS[str(kind)]]
    sub = Submission(stem, doc)
    previous = None
    for i, item in enumerate(items, start=1):
        item["id"] = f"{doc.get('id') or stem}-{i}-{run_id}"
        job, note = _fit(item, caps)
        name = f"{label.split(' ')[0]} {kind} {i}/{len(items)}"
        after = previous if kind == "chain" else None
        sub.jobs.append(_demo_job(item["id"], name, job, caps, note, after))
        previous = item["id"]
    return sub


def _demo_job(
    task_id: str,
    label: str,
    job: Job,
    caps: dict[str, Capabilities],
    note: str,
    after: str | None = None,
) -> DemoJob:
    return DemoJob(
        task_id=task_id,
        label=label,
        task=str(job.type),
        band=band(job.requirements),
        routed=has_hard_constraints(job.requirements),
        eligible=eligible_nodes(job, caps),
        note=note,
        after=after,
    )


def eligible_nodes(job: Job, caps: dict[str, Capabilities]) -> frozenset[str]:
    """The fleet nodes that can ever run `job` (FITS or WAIT on an idle node)."""
    return frozenset(host for host, c in caps.items() if match(job.requirements, c).eligible)


def _fit(item: dict[str, Any], caps: dict[str, Capabilities]) -> tuple[Job, str]:
    """Parse a job; swap in a GPU model the fleet has (editing `item`) when only that makes
    it runnable.

    A workflow step or group job asking for an H100 or a T4 would stall its whole
    workflow, so it gets the nearest GPU the fleet has (H100 -> A100, T4 -> L4), and the
    table says so. Stand-alone jobs that still fit nowhere (§13.2's node selector and
    compute capability 9.0, §13.3's TPU, the impossible job) are submitted as published
    and must wait with a pending reason."""
    job = parse_job(item)
    wanted = item.get("ext_ml_gpu_type")
    if eligible_nodes(job, caps) or wanted not in SUBSTITUTES:
        return job, ""
    trial = {**item, "ext_ml_gpu_type": SUBSTITUTES[str(wanted)]}
    try:
        swapped = parse_job(trial)
    except SpecError:  # e.g. a compute capability the other model lacks: keep the original
        return job, ""
    if not eligible_nodes(swapped, caps):
        return job, ""
    item["ext_ml_gpu_type"] = trial["ext_ml_gpu_type"]
    return swapped, f"{wanted} -> {trial['ext_ml_gpu_type']}"
