"""The demo's live table: where each job runs, on which devices, and why a job waits.

Key decision: on a terminal the table is redrawn in place; anywhere else
(`make demo | tee`, CI, tests) each change is printed as one line and the
table is printed once at the end, so a log stays readable and greppable.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import TextIO

from celery_ojs_ml.demo.watch import DONE, HELD, RUNNING, WAITING, Row

COLUMNS = ("job", "task", "band", "node", "devices", "state", "time (s)")


def devices_text(devices: Sequence[int], *, ran: bool) -> str:
    """`GPU 0-3,6` for GPU jobs, `cpu` for a job that ran without GPUs, `-` otherwise."""
    if not devices:
        return "cpu" if ran else "-"
    ordered = sorted(devices)
    spans: list[str] = []
    start = prev = ordered[0]
    for d in [*ordered[1:], None]:
        if d is not None and d == prev + 1:
            prev = d
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if d is not None:
            start = prev = d
    return "GPU " + ",".join(spans)


def _cells(row: Row, t0: float) -> tuple[str, ...]:
    ran = row.state in (DONE, RUNNING)
    span = ""
    if row.started is not None:
        end = f"{row.finished - t0:.1f}" if row.finished is not None else ""
        span = f"{row.started - t0:.1f}-{end}"
    label = row.job.label + (" *" if row.job.note else "")
    node = row.node or "-"
    return (
        label,
        row.job.task,
        row.job.band if row.job.routed else "plain",
        node,
        devices_text(row.devices, ran=ran),
        row.state,
        span,
    )


def render(rows: Sequence[Row], t0: float, width: int | None = None) -> list[str]:
    """The table's lines, then notes: substitutions, then why each waiting job waits."""
    width = width or shutil.get_terminal_size((120, 40)).columns
    cells = [COLUMNS, *(_cells(r, t0) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)).rstrip()
             for cell in cells]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    if any(not r.job.routed for r in rows):
        lines.append(
            "band plain: no hard constraints, so plain Celery routing (any worker, no gate)"
        )
    for row in rows:
        if row.job.note:
            lines.append(f"* {row.job.label}: {row.job.note} (the demo fleet has no such GPU)")
    for row in rows:
        if row.state in (WAITING, HELD) and row.reason:
            head = f"{row.job.label} {row.state}: "
            lines += textwrap.wrap(
                row.reason,
                width=max(60, width - 2),
                initial_indent=head,
                subsequent_indent="    ",
                break_on_hyphens=False,
            )
    return lines


def change_line(row: Row, t0: float, now: float) -> str:
    """One line for a job whose state changed (the non-terminal log form)."""
    where = f" on {row.node}" if row.node else ""
    devices = f" ({devices_text(row.devices, ran=True)})" if row.state in (DONE, RUNNING) else ""
    why = f": {row.reason}" if row.state in (WAITING, HELD) and row.reason else ""
    if row.state == WAITING and row.estimate is not None:
        why += f" (start estimate: in {max(0.0, row.estimate - now):.0f} s, from time limits)"
    return f"[{now - t0:5.1f}s] {row.job.label:<28} {row.state}{where}{devices}{why}"


class LivePrinter:
    """Prints the table live: redrawn on a terminal, as change lines otherwise."""

    def __init__(self, out: TextIO | None = None, *, live: bool | None = None) -> None:
        self.out = out or sys.stdout
        self.live = self.out.isatty() if live is None else live
        self._drawn = 0
        self._second = -1
        self._last: dict[str, tuple[str, str | None, tuple[int, ...], bool]] = {}

    def say(self, text: str) -> None:
        """A line above the table."""
        self._undraw()
        print(text, file=self.out, flush=True)

    def update(self, rows: Sequence[Row], t0: float, now: float) -> None:
        """Show the rows as they are now."""
        changed = [r for r in rows if self._last.get(r.job.task_id) != _key(r)]
        self._last.update({r.job.task_id: _key(r) for r in rows})
        if self.live:
            if changed or int(now - t0) != self._second:
                self._redraw(rows, t0, now)
            return
        for row in changed:
            print(change_line(row, t0, now), file=self.out, flush=True)

    def finish(self, rows: Sequence[Row], t0: float) -> None:
        """The final table (a terminal already shows it)."""
        self._undraw()
        print(file=self.out)
        for line in render(rows, t0):
            print(line, file=self.out)
        self.out.flush()

    def _redraw(self, rows: Sequence[Row], t0: float, now: float) -> None:
        # Lines are cut to the terminal so that each takes exactly one row, and
        # the cursor can move back over all of them for the next redraw.
        self._undraw()
        columns, height = shutil.get_terminal_size((120, 40))
        lines = render(rows, t0, columns)[: max(3, height - 2)]
        lines = [line[: columns - 1] for line in [*lines, f"[{now - t0:.1f}s]"]]
        print("\n".join(lines), file=self.out, flush=True)
        self._drawn = len(lines)
        self._second = int(now - t0)

    def _undraw(self) -> None:
        if self.live and self._drawn:
            self.out.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0


def _key(row: Row) -> tuple[str, str | None, tuple[int, ...], bool]:
    return (row.state, row.node, row.devices, row.estimate is not None)
