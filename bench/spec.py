"""Spec-layer benchmark: validate + normalise + class hash, and matching a fleet.

Reports medians and compares the publish-side cost with plain Celery building
the same task message (`app.amqp.as_task_v2`), as a ratio. Targets: 50 us for
the §13.2 envelope and 20 ms to match one job against 1,000 workers.

    .venv/bin/python bench/spec.py [--repeat 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery

from celery_ojs_ml.matching import rank
from celery_ojs_ml.spec.classes import class_id
from celery_ojs_ml.spec.envelope import parse_job
from celery_ojs_ml.testing.builders import worker_with

ROOT = Path(__file__).resolve().parents[1]
ENVELOPE = json.loads((ROOT / "examples/jobs/v03-13.2-large-scale-training-job.json").read_text())


def median_us(fn: Callable[[], Any], repeat: int) -> float:
    """Median wall time of one call, in microseconds."""
    for _ in range(min(200, repeat)):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


def validate_and_hash() -> str:
    return class_id(parse_job(ENVELOPE).requirements)


def plain_celery_message(app: Celery) -> Callable[[], Any]:
    def build() -> Any:
        return app.amqp.as_task_v2(str(uuid.uuid4()), "ml.train", args=ENVELOPE["args"])

    return build


def fleet(n: int) -> dict[str, Any]:
    kinds = [("nvidia-h100", 8), ("nvidia-a100", 8), ("nvidia-l4", 1), ("nvidia-t4", 4), (None, 0)]
    out = {}
    for i in range(n):
        gpu_type, gpus = kinds[i % len(kinds)]
        labels = {"cluster": "ml-training-prod", "instance_type": "p5.48xlarge"}
        out[f"w{i}"] = worker_with(
            gpus=gpus,
            gpu_type=gpu_type,
            interconnect="nvlink" if gpus > 1 else None,
            cpu_cores=192,
            ram_gb=2048,
            labels=labels,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    app = Celery("bench", broker="memory://", set_as_current=False)
    ours = median_us(validate_and_hash, args.repeat)
    plain = median_us(plain_celery_message(app), args.repeat)
    req = parse_job(ENVELOPE).requirements
    workers = fleet(1000)
    match_ms = median_us(lambda: rank(req, workers), max(20, args.repeat // 100)) / 1000
    eligible = sum(1 for _, r in rank(req, workers) if r.eligible)
    print(f"validate+normalise+class-hash §13.2 : {ours:8.1f} us median (target <= 50 us)")
    print(f"plain Celery as_task_v2 same args   : {plain:8.1f} us median")
    print(f"ratio (ours / plain message build)  : {ours / plain:8.2f}x")
    print(
        f"match 1 job against 1,000 workers   : {match_ms:8.2f} ms median (target <= 20 ms), "
        f"{eligible} eligible"
    )


if __name__ == "__main__":
    main()
