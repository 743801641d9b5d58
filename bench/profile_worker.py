"""Sample a worker's main process under a burst of no-op jobs (py-spy).

Starts a private redis-server and one of the dispatch bench's workers
(`bench/dispatch.py`: prefork `-c 2`; `--variant plugin`: 1-GPU jobs on 8
simulated GPUs, grants off; `grants`: the same with the defaults; `plain`: plain
Celery, no-op jobs), warms it up, then records the worker's main process with
py-spy while `--jobs` jobs run, and prints where the samples fall: inclusive, by
function, as a share of the samples and as CPU microseconds per job (samples /
sampling rate / jobs; the sampler runs with the GIL-holding and idle frames out,
so the figures are time the main process spent on the CPU); the plugin's frames
separately. `--children` samples the pool children too. py-spy is not a
dependency: install it anywhere and pass its path.

    pip install --target /tmp/pyspy py-spy
    .venv/bin/python bench/profile_worker.py --py-spy /tmp/pyspy/bin/py-spy \
        [--variant plain|plugin|grants] [--jobs 3000]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.dispatch import GRANTS, PLAIN, PLUGIN, Variant, Worker, private_redis  # noqa: E402
from bench.dispatch_app import RESULTS_KEY, make_app  # noqa: E402

VARIANTS = {"plain": PLAIN, "plugin": PLUGIN, "grants": GRANTS}
RATE_HZ = 200


def record(
    py_spy: str, variant: Variant, jobs: int, out: Path, children: bool = False
) -> tuple[float, int]:
    """Run the burst under py-spy; returns (jobs per second, jobs sampled)."""
    with tempfile.TemporaryDirectory() as tmp, private_redis(Path(tmp)) as broker:
        worker = Worker(variant, broker, Path(tmp), 4, "spy")
        app = make_app(broker, plugin=variant.plugin, grants=variant.grants)
        try:
            if variant.plugin:
                worker.wait_live(app.ojs_ml.store)
            time.sleep(2.0)  # the scheduler elected, the subscription settled
            task, client = app.tasks[variant.task], redis.Redis.from_url(broker)
            _burst(task, variant, client, "warm", 50)
            argv = [py_spy, "record", "-p", str(worker.proc.pid), "-r", str(RATE_HZ),
                    "-f", "raw", "-o", str(out), "--nonblocking"]  # fmt: skip
            if children:
                argv.append("--subprocesses")
            spy = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            began = time.time()
            _burst(task, variant, client, "run", jobs)
            rate = jobs / (time.time() - began)
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            spy.wait(timeout=60)
            return rate, jobs
        finally:
            worker.stop()
            app.close()


def _burst(task: object, variant: Variant, client: redis.Redis, run: str, n: int) -> None:
    client.delete(RESULTS_KEY)
    for i in range(n):
        task.apply_async(args=[run, i, time.time(), 0.0], queue=variant.queue)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 120
    while client.llen(RESULTS_KEY) < n and time.monotonic() < deadline:
        time.sleep(0.02)


def summary(raw: Path, top: int, jobs: int) -> str:
    """Inclusive share of samples per function, all frames and the plugin's frames, with
    the CPU microseconds per job each share stands for."""
    every: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        names = {
            f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].split(":")[0] for f in stack.split(";")
        }
        for name in names:
            every[name] += n
        for name in {f.split(" (")[0] for f in stack.split(";") if "celery_ojs_ml" in f}:
            ours[name] += n
    per_job = 1e6 / RATE_HZ / max(jobs, 1)
    lines = [f"{total} samples, {total * per_job:.0f} us of CPU per job "
             "(frames in over 90% of them, the event loop's, left out)"]  # fmt: skip
    inner = [(k, v) for k, v in every.most_common() if v <= 0.9 * total][:top]
    row = "{:5.1f}% {:7.0f} us/job  {}"
    lines += [row.format(100 * v / total, v * per_job, k) for k, v in inner]
    lines += ["-- celery_ojs_ml frames"]
    lines += [row.format(100 * v / total, v * per_job, k) for k, v in ours.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--py-spy", required=True, help="path of the py-spy executable")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="plugin")
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--children", action="store_true", help="sample the pool children too")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "ojs-spy.txt"))
    args = parser.parse_args()
    variant = VARIANTS[args.variant]
    rate, jobs = record(args.py_spy, variant, args.jobs, Path(args.out), args.children)
    print(f"{variant.label}: {rate:.0f} jobs/s under py-spy (slower than unsampled)")
    print(summary(Path(args.out), args.top, jobs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
