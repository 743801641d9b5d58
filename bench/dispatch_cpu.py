"""Where the dispatch bench's CPU goes: CPU time per task of every process, by role.

Runs `bench/dispatch.py`'s plain and plugin workers (the same app, prefork `-c 2`, 8
simulated GPUs for the plugin) on a private `redis-server`, alternates throughput
segments of `--tasks` no-op tasks between them, and reports for each variant the
tasks/s and the user+system CPU per task of: the worker's main process, its pool
children, the plugin's scheduler process (the leader, a spawned child of the worker),
Redis, and this process (which publishes). Both variants are CPU-bound on a 2-core
machine, so the throughput ratio follows the totals (docs/performance.md, "Methods").
`--redis-commands` also counts the Redis commands of one plugin burst by command and key
shape (Redis `MONITOR`); `lua` marks a command run inside a script (no round trip of its
own).

    .venv/bin/python bench/dispatch_cpu.py [--tasks 600] [--segments 3] [--redis-commands]
        [--grants]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.dispatch import GRANTS, PLAIN, PLUGIN, Bench, Variant, Worker, private_redis  # noqa: E402


def _role(proc: psutil.Process, worker: Worker) -> str:
    if proc.pid == worker.proc.pid:
        return "worker main process"
    cmdline = " ".join(proc.cmdline())
    if "multiprocessing" in cmdline and "resource_tracker" in cmdline:
        return "resource tracker"
    if "multiprocessing" in cmdline:
        return "scheduler process (leader)"
    return "pool children (all)"


def _cpu(procs: Sequence[psutil.Process]) -> dict[int, float]:
    out = {}
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[proc.pid] = t.user + t.system
    return out


def _redis_process(url: str) -> psutil.Process:
    port = url.rsplit(":", 1)[1].split("/")[0]
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []  # redis-server retitles itself "redis-server HOST:PORT"
        if argv and "redis-server" in argv[0] and port in " ".join(argv):
            return proc
    raise RuntimeError(f"no redis-server on port {port}")


def segment(
    bench: Bench, variant: Variant, worker: Worker, n: int, server: psutil.Process
) -> tuple[float, dict[str, float]]:
    """One throughput segment: tasks/s and CPU ms per task by role."""
    main = psutil.Process(worker.proc.pid)
    procs = [main, *main.children(recursive=True), server]
    before, mine = _cpu(procs), sum(os.times()[:2])
    tasks_per_s = float(bench.throughput(variant, worker, n)["tasks_per_s"])
    after, mine_after = _cpu(procs), sum(os.times()[:2])
    roles: dict[str, float] = collections.defaultdict(float)
    for proc in procs:
        if proc.pid in before and proc.pid in after:
            role = "redis" if proc is server else _role(proc, worker)
            roles[role] += (after[proc.pid] - before[proc.pid]) / n * 1000
    roles["publisher (this process)"] = (mine_after - mine) / n * 1000
    return tasks_per_s, dict(roles)


def redis_commands(
    bench: Bench, variant: Variant, worker: Worker, url: str, n: int
) -> list[tuple[float, str]]:
    """Redis commands per task of one plugin burst, by command and key shape."""
    client = redis.Redis.from_url(url)
    seen: collections.Counter[str] = collections.Counter()
    stop = threading.Event()

    def watch() -> None:
        with client.monitor() as mon:
            for cmd in mon.listen():
                if stop.is_set():
                    return
                parts = str(cmd["command"]).split(" ")
                key = parts[1] if len(parts) > 1 else ""
                script = ""
                if parts[0].upper() == "EVALSHA":  # the script by its sha, then its first key
                    script, key = parts[1][:6] + " ", parts[3] if len(parts) > 3 else ""
                key = re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}", "<id>", key)
                shape = script + re.sub(r"[0-9]+", "N", key)
                where = "lua " if cmd.get("client_type") == "lua" else ""
                seen[f"{where}{parts[0].upper():10s} {shape[:60]}"] += 1

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    time.sleep(0.5)
    bench.throughput(variant, worker, n)
    time.sleep(0.5)
    stop.set()
    client.ping()  # one more command, so the monitor loop sees `stop`
    thread.join(5)
    return [(count / n, what) for what, count in seen.most_common(60)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=600, help="tasks per segment")
    parser.add_argument("--segments", type=int, default=3, help="segments per variant")
    parser.add_argument("--redis-commands", action="store_true")
    parser.add_argument(
        "--grants",
        action="store_true",
        help="the plugin with its defaults (ojs_ml_grants on); without it, ojs_ml_grants off",
    )
    args = parser.parse_args(argv)
    ml = GRANTS if args.grants else PLUGIN
    with tempfile.TemporaryDirectory() as tmp, private_redis(Path(tmp)) as url:
        bench = Bench(url, Path(tmp), 4)
        server = _redis_process(url)
        with bench.worker(PLAIN, "a") as plain, bench.worker(ml, "b") as plugin:
            time.sleep(1.0)
            rates: dict[str, list[float]] = {"plain": [], "plugin": []}
            cpu: dict[str, dict[str, list[float]]] = {"plain": {}, "plugin": {}}
            for _ in range(args.segments):
                for key, variant, worker in (("plain", PLAIN, plain), ("plugin", ml, plugin)):
                    rate, roles = segment(bench, variant, worker, args.tasks, server)
                    rates[key].append(rate)
                    for role, ms in roles.items():
                        cpu[key].setdefault(role, []).append(ms)
            for key in ("plain", "plugin"):
                print(f"{key}: tasks/s {', '.join(f'{r:.0f}' for r in rates[key])}")
                means = {role: statistics.mean(v) for role, v in cpu[key].items()}
                for role, ms in sorted(means.items(), key=lambda kv: -kv[1]):
                    print(f"  {ms:6.3f} ms/task  {role}")
                print(f"  {sum(means.values()):6.3f} ms/task  total")
            ratio = statistics.median(rates["plugin"]) / statistics.median(rates["plain"])
            print(f"throughput ratio (medians): {ratio:.2f}")
            if args.redis_commands:
                print("Redis commands per task, one plugin burst:")
                for per_task, what in redis_commands(bench, ml, plugin, url, args.tasks):
                    print(f"  {per_task:6.2f}  {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
