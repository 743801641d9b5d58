"""Shared test helpers: where the specs and examples live, and small builders."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.normalize import normalize

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SPEC_DIR = ROOT.parent / "shared" / "spec"


def spec_text(name: str) -> str:
    """The text of one spec document; fails loudly when shared/ is missing."""
    path = SPEC_DIR / name
    assert path.exists(), f"spec {path} is missing: tests read the specs from ../shared/spec"
    return path.read_text(encoding="utf-8")


def flat(**attrs: Any) -> dict[str, Any]:
    """Normalise keyword attributes (without the ext_ml_ prefix) to the flat canonical form."""
    return normalize({f"ext_ml_{k}": v for k, v in attrs.items()}).flat()


def rejects(attrs: dict[str, Any]) -> SpecError:
    """Assert normalisation rejects `attrs` and return the error."""
    with pytest.raises(SpecError) as info:
        normalize(attrs)
    return info.value


def free_port() -> int:
    """A free loopback port for a private server; never Redis' default 6379."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port != 6379:
            return port


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a server we started; kill it if it does not stop within 5 s."""
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
