"""`bench/replay.py --mode time`: the scheduler over time on a scaled cluster (to be built)."""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the time mode."""


def main(opts: argparse.Namespace) -> dict[str, Any]:
    """Run the time mode; the JSON-able result."""
    raise SystemExit("--mode time is not built yet")
