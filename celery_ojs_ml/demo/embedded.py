"""The embedded demo: three workers in this process on `memory://`, fakeredis as the store.

Key decisions (research/celery-internals.md §10, docs/demo.md):
* Workers run under the threads pool through Celery's own `start_worker`, sharing one
  app, one `memory://` broker and one fakeredis server; the plugin keeps queues and
  gate state per consumer, so they behave like three machines. Tasks report the
  devices the gate gave them (threads cannot pin `CUDA_VISIBLE_DEVICES`).
* The nodes start smallest first (CPU, L4, A100), so CPU-only jobs tend to win the
  race to the CPU node; the order never changes who is allowed to run a job.
* Leaving one `start_worker` context stops every worker in the process
  (`celery.worker.state.should_terminate` is process-global): they stop together.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from celery_ojs_ml.demo import session
from celery_ojs_ml.demo.app import make_app
from celery_ojs_ml.demo.jobs import EXAMPLES, FLEET, fleet_capabilities
from celery_ojs_ml.demo.table import LivePrinter
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.store.registry import OJSStore

CONCURRENCY = 4


def run_embedded(
    printer: LivePrinter,
    *,
    timeout_s: float = 40.0,
    examples: Path = EXAMPLES,
    verbose: bool = False,
) -> session.Outcome:
    """Start the fleet in process, run one session, stop the fleet."""
    try:
        import fakeredis
    except ImportError:  # pragma: no cover - fakeredis is in the dev and embedded extras
        raise ConfigError(
            "the embedded demo needs fakeredis; install it with "
            "`pip install 'celery-ojs-ml[embedded]'`, or run the demo against Redis with "
            "`--broker redis://127.0.0.1:6379/0`"
        ) from None
    from celery.contrib.testing.worker import start_worker

    app = make_app("memory://")
    app.ojs_ml.use_store(OJSStore(fakeredis.FakeRedis(server=fakeredis.FakeServer())))
    submissions = session.prepare(examples)
    pinning = "off under the threads pool; tasks report request.ojs_devices"
    printer.say("Fleet (3 workers in this process, broker memory://, store fakeredis):")
    for line in session.fleet_banner(fleet_capabilities(), pinning):
        printer.say(line)
    with ExitStack() as stack:
        for host, capabilities in reversed(FLEET.items()):
            stack.enter_context(
                start_worker(
                    app,
                    pool="threads",
                    concurrency=CONCURRENCY,
                    perform_ping_check=False,
                    hostname=host,
                    loglevel="INFO" if verbose else "ERROR",
                    ojs_ml_capabilities=capabilities,
                )
            )
        session.wait_for_fleet(app.ojs_ml.store, FLEET, timeout_s=10.0)
        outcome = session.run(app, submissions, printer, timeout_s=timeout_s)
    app.close()
    return outcome
