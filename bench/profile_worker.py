"""Sample the plugin worker's main process under a burst of 1-GPU no-op jobs (py-spy).

Starts a private redis-server and the dispatch bench's plugin worker
(`bench/dispatch.py`: prefork `-c 2`, 8 simulated GPUs), warms it up, then
records the worker's main process with py-spy while `--jobs` jobs run, and
prints where the samples fall (inclusive, by function; the plugin's frames
separately). py-spy is not a dependency: install it anywhere and pass its path.

    pip install --target /tmp/pyspy py-spy
    .venv/bin/python bench/profile_worker.py --py-spy /tmp/pyspy/bin/py-spy [--jobs 3000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.dispatch import PLUGIN, Worker, private_redis  # noqa: E402
from bench.dispatch_app import RESULTS_KEY, make_app  # noqa: E402


def record(py_spy: str, jobs: int, seconds: int, out: Path) -> float:
    """Run the burst under py-spy; returns jobs per second."""
    with tempfile.TemporaryDirectory() as tmp, private_redis(Path(tmp)) as broker:
        worker = Worker(PLUGIN, broker, Path(tmp), 4, "spy")
        app = make_app(broker, plugin=True)
        try:
            worker.wait_live(app.ojs_ml.store)
            time.sleep(2.0)  # the scheduler elected, the subscription settled
            task, client = app.tasks["bench.gpu_noop"], redis.Redis.from_url(broker)
            _burst(task, client, "warm", 50)
            argv = [py_spy, "record", "-p", str(worker.proc.pid), "-r", "200", "-d", str(seconds),
                    "-f", "raw", "-o", str(out), "--nonblocking"]  # fmt: skip
            spy = subprocess.Popen(argv)
            time.sleep(0.5)
            began = time.time()
            _burst(task, client, "run", jobs)
            rate = jobs / (time.time() - began)
            spy.wait()
            return rate
        finally:
            worker.stop()
            app.close()


def _burst(task: object, client: redis.Redis, run: str, n: int) -> None:
    client.delete(RESULTS_KEY)
    for i in range(n):
        task.apply_async(args=[run, i, time.time(), 0.0], queue=PLUGIN.queue)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 120
    while client.llen(RESULTS_KEY) < n and time.monotonic() < deadline:
        time.sleep(0.05)


def summary(raw: Path, top: int) -> str:
    """Inclusive share of samples per function, all frames and the plugin's frames."""
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
    lines = [f"{total} samples (frames in over 90% of them, the event loop's, left out)"]
    inner = [(k, v) for k, v in every.most_common() if v <= 0.9 * total][:top]
    lines += [f"{100 * v / total:5.1f}% {k}" for k, v in inner]
    lines += ["-- celery_ojs_ml frames"]
    lines += [f"{100 * v / total:5.1f}% {k}" for k, v in ours.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--py-spy", required=True, help="path of the py-spy executable")
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "ojs-spy.txt"))
    args = parser.parse_args()
    rate = record(args.py_spy, args.jobs, args.seconds, Path(args.out))
    print(f"{rate:.0f} jobs/s under py-spy (slower than unsampled)")
    print(summary(Path(args.out), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
