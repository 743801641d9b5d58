"""File reading for the CLI: documents and worker fleets, with exit-code-2 errors.

Key decision: an unreadable file or a syntax error is a usage problem
(`click.UsageError`-like, exit 2); a readable document that breaks the spec is
a validation failure (exit 1). Commands never print tracebacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from celery_ojs_ml.capabilities import Capabilities, parse_capabilities
from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.documents import load_text

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2

_CONTROLS = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)}
"""Control characters and line separators -> their Python escapes (`\\n`, `\\x1b`)."""


def one_line(text: str) -> str:
    """`text` with control characters escaped: a violation quotes document keys and
    values verbatim, and a key holding a line break or an escape sequence must not split
    its line or reach the terminal raw."""
    return text.translate(_CONTROLS)


def complain(text: str) -> None:
    """Print one line to stderr, control characters escaped (`one_line`)."""
    click.echo(one_line(text), err=True)


class Unreadable(click.ClickException):
    """A file that cannot be read or parsed; exits 2 like a usage error."""

    exit_code = EXIT_USAGE


def read_document(path: str) -> Any:
    """Read and parse one JSON or YAML file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise Unreadable(f"cannot read {path}: {exc}") from None
    try:
        return load_text(text, name=path)
    except SpecError as exc:
        raise Unreadable(str(exc)) from None


def read_workers(path: str) -> dict[str, Capabilities]:
    """Workers from a directory of files, a file holding a list, or a single worker file."""
    p = Path(path)
    files = (
        sorted(f for f in p.iterdir() if f.suffix in (".json", ".yaml", ".yml"))
        if p.is_dir()
        else [p]
    )
    fleet: dict[str, Capabilities] = {}
    for f in files:
        doc = read_document(str(f))
        docs = doc if isinstance(doc, list) and doc and isinstance(doc[0], dict) else [doc]
        for i, item in enumerate(docs):
            caps = worker_from(item, f"{f}" if len(docs) == 1 else f"{f}[{i}]")
            fleet[caps.worker_id or (f.stem if len(docs) == 1 else f"{f.stem}-{i}")] = caps
    return fleet


def worker_from(doc: Any, name: str) -> Capabilities:
    """Parse one worker document, turning spec errors into exit-2 messages."""
    try:
        return parse_capabilities(doc)
    except SpecError as exc:
        raise Unreadable(f"{name}: {exc}") from None
