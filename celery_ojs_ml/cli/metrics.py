"""`metrics`: serve the fleet's metrics for Prometheus on `/metrics`.

Key decision: the exporter is a process of its own (`celery_ojs_ml.exporter`),
started next to any worker's app: it reads the store the app's plugin uses and the
app's broker's event stream, so one exporter covers the whole fleet. It listens on
127.0.0.1 unless told otherwise, as the metrics describe the fleet's jobs.
"""

from __future__ import annotations

import signal
import threading

import click

from celery_ojs_ml.cli.app import app_option, load_plugin

DEFAULT_PORT = 9808
DEFAULT_ADDRESS = "127.0.0.1"


@click.command()
@app_option
@click.option(
    "--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True,
    help="TCP port to serve /metrics on (0: any free port).",
)  # fmt: skip
@click.option(
    "--address", default=DEFAULT_ADDRESS, show_default=True,
    help="Address to listen on; 0.0.0.0 for every interface (e.g. in a container).",
)  # fmt: skip
@click.option(
    "--no-events", is_flag=True,
    help="Do not read the event stream: store gauges only, the counters stay empty.",
)  # fmt: skip
@click.pass_context
def metrics(
    ctx: click.Context, app_name: str | None, port: int, address: str, no_events: bool
) -> None:
    """Serve the fleet's Prometheus metrics (docs/metrics.md) until interrupted."""
    from celery_ojs_ml.exporter import Exporter

    plugin = load_plugin(ctx, app_name)
    app = None if no_events else plugin.app
    exporter = Exporter(plugin.store, app, address=address, port=port)
    try:
        served = exporter.start()
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {address}:{port}: {exc}") from None
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    events = "without events" if no_events else "counting ojs-* events"
    click.echo(f"ojs-ml metrics on http://{address}:{served}/metrics ({events})", err=True)
    done.wait()
    exporter.stop()
