"""Shared test helpers: where the specs and examples live, and small builders."""

from __future__ import annotations

import random
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


def _ephemeral_floor() -> int:
    """The first port the kernel hands to outgoing connections (32768 by default)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port for a private server; never Redis' default 6379.

    It is drawn at random below the kernel's ephemeral range, so an outgoing connection
    (a test's own client) cannot take it between this check and the server's bind, and
    two xdist processes are unlikely to draw the same one."""
    high = _ephemeral_floor()
    low = max(1024, high - 12000)
    while True:
        port = random.randrange(low, high) if high - low > 100 else 0
        if port == 6379:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            found = int(sock.getsockname()[1])
        if found != 6379:
            return found


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a server we started; kill it if it does not stop within 5 s."""
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
