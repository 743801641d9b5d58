"""URI safety checks shared by checkpoint, model-registry and artifact URIs.

Key decision: the checks are an allow-list (scheme, then optional prefixes)
plus a deny-list of the classic attacks: path traversal (also percent-encoded),
embedded credentials, control characters, and SSRF to loopback, link-local or
private address literals (OJS ML §15.2-§15.3). For artifact URIs (OJS ML
Extensions §12.1) an operator's prefix is the only way to reach a local file or
an internal host: a prefix is an explicit, reviewed grant, a job is not.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Iterator, Sequence
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
    if internal_host(parts.hostname):
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


def artifact_reach_problem(uri: str, prefixes: Sequence[str]) -> str | None:
    """Why `uri` reaches where artifact URIs may not (OJS ML Extensions §12.1); None if fine.

    With `prefixes`, every URI must lie under one of them, and one that does
    may name a local file or an internal host. Without, `file://` URIs and
    internal hosts are refused: a job must not pick what a worker reads.
    """
    if prefixes:
        return None if any(under_prefix(uri, p) for p in prefixes) else _NOT_UNDER
    parts = urlsplit(uri)
    if parts.scheme == "file":
        return _NOT_UNDER
    if internal_host(parts.hostname):
        return f"points at an internal address {parts.hostname!r} (SSRF)"
    return None


_NOT_UNDER = "is not under an allowed prefix"


def under_prefix(uri: str, prefix: str) -> bool:
    """Whether `uri` lies under `prefix`, matching whole path segments only.

    `s3://models` admits `s3://models/v1/m.bin` but not `s3://models-evil/m.bin`.
    """
    if not prefix or not uri.startswith(prefix):
        return False
    return prefix.endswith("/") or len(uri) == len(prefix) or uri[len(prefix)] in "/?#"


def _traverses(path: str) -> bool:
    decoded = unquote(unquote(path))
    return any(seg == ".." for seg in decoded.replace("\\", "/").split("/"))


def internal_host(host: str | None) -> bool:
    """Whether `host` is loopback, link-local, private or unspecified, or a metadata service.

    Only literals and well-known names are caught here; a public name that
    resolves to an internal address is the network's egress policy to stop.
    """
    if not host:
        return False
    if host in ("localhost", "metadata.google.internal"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_link_local or ip.is_private or ip.is_unspecified
