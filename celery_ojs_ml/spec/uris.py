"""URI safety checks shared by checkpoint, model-registry and artifact URIs.

Key decision: the checks are an allow-list (scheme, then optional prefixes)
plus a deny-list of the classic attacks: path traversal (also percent-encoded),
embedded credentials, control characters, and SSRF to loopback, link-local or
private address literals (OJS ML §15.2-§15.3).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

_CONTROL = re.compile(r"[\x00-\x20\x7f]")


@dataclass(frozen=True, slots=True)
class UriProblem:
    """One reason a URI is refused, with the spec section that demands it."""

    text: str
    section: str


def uri_problems(
    uri: str, schemes: Iterable[str], section: str = "OJS ML §15.2"
) -> Iterator[UriProblem]:
    """Why `uri` is unsafe or not allowed; empty when it is fine."""
    allowed = sorted(schemes)
    if _CONTROL.search(uri):
        yield UriProblem("contains whitespace or control characters", section)
        return
    parts = urlsplit(uri)
    if not parts.scheme or parts.scheme not in allowed:
        scheme = parts.scheme or "no scheme"
        yield UriProblem(f"uses {scheme!r}; allowed schemes are {', '.join(allowed)}", section)
        return
    if _traverses(parts.path) or _traverses(parts.netloc):
        yield UriProblem("contains a '..' path segment (path traversal)", section)
    if "@" in parts.netloc:
        yield UriProblem("embeds credentials in the authority part", section)
    if _internal_host(parts.hostname):
        yield UriProblem(f"points at an internal address {parts.hostname!r} (SSRF)", section)
    if parts.scheme == "file" and parts.netloc not in ("", "localhost"):
        yield UriProblem("is a file URI with a remote host; use file:///absolute/path/", section)


def checkpoint_problems(
    uri: str, schemes: Iterable[str], prefixes: Iterable[str] = ()
) -> Iterator[UriProblem]:
    """Why `uri` cannot be a checkpoint storage prefix (OJS ML §9.4, §15.3)."""
    problems = list(uri_problems(uri, schemes, "OJS ML §15.3"))
    yield from problems
    if problems:
        return
    if not uri.endswith("/"):
        yield UriProblem("must end with '/' to name a directory prefix", "OJS ML §9.4")
    allowed = tuple(prefixes)
    if allowed and not uri.startswith(allowed):
        yield UriProblem(f"is outside the allowed prefixes {list(allowed)}", "OJS ML §15.3")


def _traverses(path: str) -> bool:
    decoded = unquote(unquote(path))
    return any(seg == ".." for seg in decoded.replace("\\", "/").split("/"))


def _internal_host(host: str | None) -> bool:
    if not host:
        return False
    if host in ("localhost", "metadata.google.internal"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_link_local or ip.is_private or ip.is_unspecified
