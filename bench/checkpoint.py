"""Checkpoint benchmark: `Checkpointer.save()` vs a raw fsspec write of the same payload.

One payload (default 100 MB) is written to `file://` in a temp dir, N times per
variant, with the variants interleaved and their order rotated each repeat:

* raw fsspec write               `fs.open(path, "wb").write(payload)`
* save(), fsync off             the full two-phase save (INCR, write, size, MULTI commit)
* raw fsspec write + fsync      the same raw write, fsynced
* save(), default (fsync on)    what a task gets by default

The ratio of each save() median to its raw median is the checkpoint machinery's
overhead (target <= 1.05). Because that overhead is a fixed cost per save (a
Redis round trip or two, metadata), a last line measures it directly with
1 KiB payloads, far less noisy than the difference of two 100 MB medians.
Outputs are deleted and the page cache flushed (`os.sync()`) outside the timed
region, so one write's writeback does not slow the next. Redis is a private
`redis-server` unless `--redis-url` is given.

    .venv/bin/python bench/checkpoint.py [--redis-url URL] [--size-mb 100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import fsspec
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from celery_ojs_ml.checkpoint import Checkpointer, CheckpointSettings  # noqa: E402
from celery_ojs_ml.spec.bounds import Bounds  # noqa: E402
from celery_ojs_ml.store.registry import OJSStore  # noqa: E402

TARGET_RATIO = 1.05
_START_TIMEOUT_S = 10.0
Op = Callable[[int], None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def private_redis() -> Iterator[str]:
    """A throwaway `redis-server` on a free loopback port, persistence off."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not on PATH; install it or pass --redis-url")
    port = _free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_for(url)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=5)


def _wait_for(url: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    with redis.Redis.from_url(url) as client:
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
    sys.exit(f"redis-server at {url} did not answer within {_START_TIMEOUT_S} s")


def raw_write(base: Path, payload: bytes, *, fsync: bool) -> Op:
    """The baseline: one fsspec write of the payload, optionally fsynced."""

    def op(i: int) -> None:
        fs, path = fsspec.core.url_to_fs(f"file://{base}/{i}/model.pt")
        fs.makedirs(str(path).rsplit("/", 1)[0], exist_ok=True)
        with fs.open(path, "wb") as handle:
            handle.write(payload)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())

    return op


def checkpoint_save(base: Path, payload: bytes, store: OJSStore, *, fsync: bool) -> Op:
    """A full `Checkpointer.save()` of the payload; retention never evicts during the run."""
    uri = f"file://{base}/"
    granted = Bounds(checkpoint_prefixes=(uri,))  # a file:// prefix must be granted
    settings = CheckpointSettings(storage_uri=uri, max_count=1000, fsync=fsync, bounds=granted)
    ckpt = Checkpointer(f"bench-{base.name}", settings, store)

    def op(i: int) -> None:
        ckpt.save(epoch=i, step=i, loss=0.1, metrics={"accuracy": 0.9}, files={"model.pt": payload})

    return op


def measure(variants: dict[str, tuple[Op, Path]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call for each variant, interleaved, one untimed warm-up round first."""
    names = list(variants)
    timings: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(repeats + 1):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for name in order:
            op, base = variants[name]
            _reset(base)
            start = time.perf_counter()
            op(rnd)
            elapsed = time.perf_counter() - start
            if rnd > 0:
                timings[name].append(elapsed)
    for _, base in variants.values():
        _reset(base)
    return timings


def _reset(base: Path) -> None:
    for child in base.iterdir():
        shutil.rmtree(child)
    os.sync()


def fixed_cost(base: Path, store: OJSStore, calls: int = 200) -> tuple[float, float]:
    """Median ms of a raw write and of a save() of 1 KiB (fsync off): the per-save fixed cost."""
    small = os.urandom(1024)
    raw, save = base / "raw-small", base / "save-small"
    raw.mkdir()
    save.mkdir()
    ops = (raw_write(raw, small, fsync=False), checkpoint_save(save, small, store, fsync=False))
    timings: tuple[list[float], list[float]] = ([], [])
    for i in range(calls):
        for op, out in zip(ops, timings, strict=True):
            start = time.perf_counter()
            op(i)
            out.append(time.perf_counter() - start)
    return statistics.median(timings[0]) * 1000, statistics.median(timings[1]) * 1000


def report(
    timings: dict[str, list[float]], size_mb: int, repeats: int, fixed: tuple[float, float]
) -> None:
    """Print the medians, the save/raw ratios and the fixed cost."""
    med = {name: statistics.median(values) * 1000 for name, values in timings.items()}
    print(f"checkpoint save vs raw fsspec write: {size_mb} MB to file://, median of {repeats}")
    print(f"{'variant':<32}{'median ms':>12}{'min ms':>10}{'max ms':>10}{'MB/s':>9}")
    for name, values in timings.items():
        lo, hi = min(values) * 1000, max(values) * 1000
        print(
            f"{name:<32}{med[name]:>12.1f}{lo:>10.1f}{hi:>10.1f}{size_mb / med[name] * 1000:>9.0f}"
        )
    for save, raw in (
        ("save(), fsync off", "raw write"),
        ("save(), fsync on", "raw write + fsync"),
    ):
        ratio = med[save] / med[raw]
        verdict = "ok" if ratio <= TARGET_RATIO else "ABOVE TARGET"
        extra = med[save] - med[raw]
        print(
            f"ratio {save} / {raw}: {ratio:.3f} (+{extra:.1f} ms; "
            f"target <= {TARGET_RATIO}) {verdict}"
        )
    raw_ms, save_ms = fixed
    print(
        f"fixed cost per save (1 KiB, median of 200): save() {save_ms:.2f} ms vs raw write "
        f"{raw_ms:.2f} ms, i.e. +{save_ms - raw_ms:.2f} ms (Redis INCR/MULTI, metadata, events)"
    )


def run(redis_url: str, size_mb: int, repeats: int) -> None:
    """Set up the variants in a temp dir and run the comparison."""
    payload = os.urandom(size_mb * 1024 * 1024)
    store = OJSStore.from_url(redis_url, prefix=f"bench-{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix="ojs-ckpt-bench-") as tmp:
        dirs = {n: Path(tmp, n) for n in ("raw", "save", "raw-fsync", "save-fsync")}
        for d in dirs.values():
            d.mkdir()
        variants = {
            "raw write": (raw_write(dirs["raw"], payload, fsync=False), dirs["raw"]),
            "save(), fsync off": (
                checkpoint_save(dirs["save"], payload, store, fsync=False),
                dirs["save"],
            ),
            "raw write + fsync": (
                raw_write(dirs["raw-fsync"], payload, fsync=True),
                dirs["raw-fsync"],
            ),
            "save(), fsync on": (
                checkpoint_save(dirs["save-fsync"], payload, store, fsync=True),
                dirs["save-fsync"],
            ),
        }
        timings = measure(variants, repeats)
        fixed = fixed_cost(Path(tmp), store)
    for key in store.client.scan_iter(match=store.key("*")):
        store.client.delete(key)
    store.close()
    report(timings, size_mb, repeats, fixed)


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--redis-url", help="use this Redis instead of a private redis-server")
    parser.add_argument("--size-mb", type=int, default=100, help="payload size (default 100)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant (default 5)")
    parser.add_argument(
        "--preemption-trials",
        type=int,
        default=3,
        help="preemptions timed on a real worker by bench/preemption.py (default 3; 0: skip)",
    )
    args = parser.parse_args(argv)
    if args.redis_url:
        run(args.redis_url, args.size_mb, args.repeats)
        _preemption(args.redis_url, args.preemption_trials)
        return
    with private_redis() as url:
        run(url, args.size_mb, args.repeats)
        _preemption(url, args.preemption_trials)


def _preemption(url: str, trials: int) -> None:
    if trials <= 0:
        return
    from bench import preemption

    print()
    preemption.report(preemption.measure(url, trials))


if __name__ == "__main__":
    main()
