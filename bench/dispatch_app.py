"""The Celery app that `bench/dispatch.py` runs in real `celery worker` processes.

Configured from the environment so that the plain and the plugin workers are
the same app with one switch:

    OJS_BENCH_BROKER   Redis URL of the broker (and of the plugin's store)
    OJS_BENCH_PLUGIN   "1": install `OJSML(app)`; "0" (default): plain Celery
    OJS_BENCH_RECYCLE  `ojs_ml_recycle_gpu_children` ("cuda", "always", "never")
    OJS_BENCH_PREFETCH worker_prefetch_multiplier (default: Celery's 4)
    OJS_BENCH_ML_PREFETCH `ojs_ml_prefetch` of the plugin (default: the plugin's)
    OJS_BENCH_GRANTS   "1": `ojs_ml_grants` on (throughput mode), store prefix `ojsg`
    OJS_BENCH_PIPELINE "0": `ojs_ml_pipeline` off (default: the plugin's, on)
    OJS_BENCH_PROFILE  FILE: cProfile of the worker's main process (ready to shutdown)
    OJS_BENCH_PROFILE_CHILDREN  DIR: cProfile of each pool child, DIR/child-PID.prof
    OJS_BENCH_GC       "1": log the main process's cyclic collections and garbage

Both tasks run the same no-op body; `bench.gpu_noop` is the one declared with
`ml={"ext_ml_gpu_count": 1}`, which the plugin routes to a requirement-class
queue and gates. Without the plugin the `ml=` option is an inert attribute.
The body records `seq published start end pid` (wall-clock seconds) in the
Redis list `RESULTS_KEY`; results are ignored, so the result backend costs
nothing in either mode.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

RESULTS_KEY = "ojs-bench:dispatch"
GRANTS_PREFIX = "ojsg"
"""Store prefix of the grants variant: the setting is the leader's, so the grants worker
forms a fleet of its own (its own leader and intake) beside the other plugin workers."""
DEFAULT_BROKER = "redis://127.0.0.1:6399/0"
_CLIENT: dict[int, redis.Redis] = {}
"""One results connection per process (created after fork, in the pool child)."""


def _client(url: str) -> redis.Redis:
    pid = os.getpid()
    client = _CLIENT.get(pid)
    if client is None:
        client = _CLIENT[pid] = redis.Redis.from_url(url)
    return client


def make_app(
    broker: str,
    *,
    plugin: bool,
    recycle: str | None = None,
    prefetch: int | None = None,
    grants: bool = False,
) -> Celery:
    """The bench app on `broker`, with or without the plugin."""
    app = Celery("ojsbench", broker=broker, set_as_current=False)
    app.conf.update(
        task_ignore_result=True,
        task_create_missing_queues=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    if prefetch is not None:
        app.conf.worker_prefetch_multiplier = prefetch
    if plugin:
        from celery_ojs_ml import OJSML

        if recycle is not None:
            app.conf.ojs_ml_recycle_gpu_children = recycle
        app.conf.ojs_ml_grants = grants  # the default is on; off: a decision per job
        if grants:  # a fleet of its own: its own leader, with grants on
            app.conf.ojs_ml_store_prefix = GRANTS_PREFIX
        if os.environ.get("OJS_BENCH_ML_PREFETCH"):
            app.conf.ojs_ml_prefetch = int(os.environ["OJS_BENCH_ML_PREFETCH"])
        if os.environ.get("OJS_BENCH_PIPELINE") == "0":
            app.conf.ojs_ml_pipeline = False
        OJSML(app)
    _define_tasks(app, broker)
    return app


def _define_tasks(app: Celery, results_url: str) -> None:
    def body(run: str, seq: int, published: float, sleep_s: float) -> None:
        start = time.time()
        if sleep_s:
            time.sleep(sleep_s)
        end = time.time()
        line = f"{run} {seq} {published!r} {start!r} {end!r} {os.getpid()}"
        _client(results_url).rpush(RESULTS_KEY, line)

    @app.task(name="bench.noop", shared=False)  # type: ignore[untyped-decorator]
    def noop(run: str, seq: int, published: float, sleep_s: float = 0.0) -> None:
        body(run, seq, published, sleep_s)

    @app.task(name="bench.gpu_noop", shared=False, ml={"ext_ml_gpu_count": 1})  # type: ignore[untyped-decorator]
    def gpu_noop(run: str, seq: int, published: float, sleep_s: float = 0.0) -> None:
        body(run, seq, published, sleep_s)


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    return None if value in (None, "") else value not in ("0", "false", "no")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


app = make_app(
    os.environ.get("OJS_BENCH_BROKER", DEFAULT_BROKER),
    plugin=bool(_env_flag("OJS_BENCH_PLUGIN")),
    recycle=os.environ.get("OJS_BENCH_RECYCLE") or None,
    prefetch=_env_int("OJS_BENCH_PREFETCH"),
    grants=bool(_env_flag("OJS_BENCH_GRANTS")),
)


def _profile_main_process(path: str) -> None:
    """`OJS_BENCH_PROFILE=FILE`: cProfile the worker's main thread from ready to shutdown."""
    import cProfile

    from celery import signals

    profiler = cProfile.Profile()

    def start(**_: object) -> None:
        profiler.enable()

    def stop(**_: object) -> None:
        profiler.disable()
        profiler.dump_stats(path)

    signals.worker_ready.connect(start, weak=False)
    signals.worker_shutdown.connect(stop, weak=False)


if os.environ.get("OJS_BENCH_PROFILE"):
    _profile_main_process(os.environ["OJS_BENCH_PROFILE"])


def _profile_children(directory: str) -> None:
    """`OJS_BENCH_PROFILE_CHILDREN=DIR`: cProfile each pool child from its start to its
    exit, into `DIR/child-PID.prof`."""
    import cProfile

    from celery import signals

    profiler = cProfile.Profile()

    def start(**_: object) -> None:
        profiler.enable()

    def stop(**_: object) -> None:
        profiler.disable()
        profiler.dump_stats(os.path.join(directory, f"child-{os.getpid()}.prof"))

    signals.worker_process_init.connect(start, weak=False)
    signals.worker_process_shutdown.connect(stop, weak=False)


if os.environ.get("OJS_BENCH_PROFILE_CHILDREN"):
    _profile_children(os.environ["OJS_BENCH_PROFILE_CHILDREN"])


def _gc_report() -> None:
    """`OJS_BENCH_GC=1`: log, at shutdown, the cyclic collections the worker's main process
    ran since ready (count and seconds by generation) and how many objects the last of
    them found to be cyclic garbage. A request held in a reference cycle shows here: it
    is freed only by the collector, dozens of objects per job (docs/performance.md)."""
    import gc
    import sys

    from celery import signals

    runs, spent, start = [0, 0, 0], [0.0, 0.0, 0.0], [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            start[0] = time.perf_counter()
            return
        runs[info["generation"]] += 1
        spent[info["generation"]] += time.perf_counter() - start[0]

    def ready(**_: object) -> None:
        gc.callbacks.append(timed)

    def report(**_: object) -> None:
        gc.callbacks.remove(timed)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found, gc.garbage[:] = len(gc.garbage), []
        gc.set_debug(0)
        spent_s = [round(s, 3) for s in spent]
        print(f"GC collections {runs} seconds {spent_s} garbage {found}", file=sys.stderr)

    signals.worker_ready.connect(ready, weak=False)
    signals.worker_shutdown.connect(report, weak=False)


if os.environ.get("OJS_BENCH_GC"):
    _gc_report()
