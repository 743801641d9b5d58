"""The `OJSML` plugin a live verb runs against, and the options every live verb takes.

Key decision: the app comes from `celery -A proj ojs-ml ...` (Celery's
`CLIContext` in `ctx.obj`) or from the verb's own `-A/--app` option, so the
console script and the Celery sub-command behave the same; an app without the
`OJSML` plugin is a usage error (exit 2). Celery is imported only when a live
verb loads its app, so offline verbs start fast. No other `cli` module is
imported here: every verb module may import this one.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from celery_ojs_ml.plugin import OJSML

_NEEDS_APP = (
    "this verb needs a Celery app with the OJSML plugin; pass it with -A, "
    "e.g. `celery -A proj ojs-ml {verb}` or `celery-ojs-ml {verb} -A proj`"
)

app_option = click.option(
    "-A",
    "--app",
    "app_name",
    metavar="MODULE[:ATTR]",
    help="The Celery app (with OJSML) when not given to `celery -A`; default $CELERY_APP.",
)
timeout_option = click.option(
    "-t",
    "--timeout",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds to wait for inspect replies.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


def load_plugin(ctx: click.Context, app_name: str | None) -> OJSML:
    """The `OJSML` plugin of the app named by `-A`, else of `celery -A`'s app."""
    from celery.app.utils import find_app

    from celery_ojs_ml.plugin import OJSML

    app = getattr(ctx.obj, "app", None)
    if not app_name and app is None:  # `celery` itself already honours $CELERY_APP
        app_name = os.environ.get("CELERY_APP")
    if app_name:
        try:
            app = find_app(app_name)
        except Exception as exc:
            raise click.UsageError(f"cannot load the app {app_name!r}: {exc}", ctx) from None
    plugin = getattr(app, "ojs_ml", None)
    if not isinstance(plugin, OJSML):
        raise click.UsageError(_NEEDS_APP.format(verb=ctx.info_name), ctx)
    return plugin
