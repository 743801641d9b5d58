"""URI safety checks shared by checkpoint, model-registry and artifact URIs.

Key decision: the checks are an allow-list (scheme, then optional prefixes)
plus a deny-list of the classic attacks: path traversal (also percent-encoded),
embedded credentials, control characters, and SSRF to loopback, link-local or
private address literals (OJS ML §15.2-§15.3). For artifact and checkpoint
storage URIs (OJS ML Extensions §12.1, OJS ML §15.3) one reach rule applies
(`reach_problem`): an operator's prefix is the only way to reach a local file or
an internal host, since a prefix is an explicit, reviewed grant and a job is not.
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
    fix: str = ""
    """How to fix it, when the problem knows better than its caller's general advice."""


def uri_problems(
    uri: str, schemes: Iterable[str], section: str = "OJS ML §15.2"
) -> Iterator[UriProblem]:
    """Why `uri` is unsafe or not allowed; empty when it is fine."""
    return _form_problems(uri, schemes, section, ssrf=True)


def _form_problems(
    uri: str, schemes: Iterable[str], section: str, *, ssrf: bool
) -> Iterator[UriProblem]:
    """Scheme, control characters, traversal, credentials, a remote `file:` host, and
    with `ssrf` an internal host."""
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
    if ssrf and internal_host(parts.hostname):
        yield UriProblem(f"points at an internal address {parts.hostname!r} (SSRF)", section)
    if parts.scheme == "file" and parts.netloc not in ("", "localhost"):
        yield UriProblem("is a file URI with a remote host; use file:///absolute/path/", section)


CHECKPOINT_PREFIXES_SETTING = "app.conf.ojs_ml_checkpoint_prefixes"
_CHECKPOINT_EXAMPLE = '"s3://bucket/checkpoints/run-1/"'
_CHECKPOINT_LOCAL = "file:///mnt/nfs/checkpoints/"
_CHECKPOINT_SECTION = "OJS ML §15.3, Extensions §12.1"


def checkpoint_problems(
    uri: str, schemes: Iterable[str], prefixes: Sequence[str] = ()
) -> Iterator[UriProblem]:
    """Why `uri` cannot be a checkpoint storage prefix (OJS ML §9.4, §15.3, Extensions §12.1)."""
    problems = list(storage_problems(uri, schemes, prefixes))
    yield from problems
    if not problems and not uri.endswith("/"):
        yield UriProblem("must end with '/' to name a directory prefix", "OJS ML §9.4")


def storage_problems(
    uri: str, schemes: Iterable[str], prefixes: Sequence[str] = ()
) -> Iterator[UriProblem]:
    """Why checkpoint storage may not be opened at `uri`: the form rules, then the reach
    rule of artifact URIs (`reach_problem`) with the checkpoint prefixes."""
    problems = list(_form_problems(uri, schemes, "OJS ML §15.3", ssrf=False))
    yield from problems
    reach = None if problems else reach_problem(uri, prefixes)
    if reach is not None and prefixes:
        reach = f"is outside the allowed prefixes {list(prefixes)}"
    if reach is not None:
        fix = reach_fix(
            uri,
            prefixes,
            CHECKPOINT_PREFIXES_SETTING,
            _CHECKPOINT_EXAMPLE,
            _CHECKPOINT_LOCAL,
            "checkpoint storage URI",
        )
        yield UriProblem(f"{uri!r} {reach}", _CHECKPOINT_SECTION, fix)


def reach_problem(uri: str, prefixes: Sequence[str]) -> str | None:
    """Why `uri` reaches where artifact and checkpoint URIs may not (OJS ML Extensions
    §12.1: no arbitrary file system access); None if fine.

    With `prefixes`, every URI must lie under one of them, and one that does
    may name a local file or an internal host. Without, `file://` URIs and
    internal hosts are refused: a job must not pick what a worker reads or writes.
    """
    if prefixes:
        return None if any(under_prefix(uri, p) for p in prefixes) else _NOT_UNDER
    parts = urlsplit(uri)
    if parts.scheme == "file":
        return _NOT_UNDER
    if internal_host(parts.hostname):
        return f"points at an internal address {parts.hostname!r} (SSRF)"
    return None


def reach_fix(
    uri: str, prefixes: Sequence[str], setting: str, example: str, local: str, noun: str
) -> str:
    """The fix for a `reach_problem`: a URI under the prefixes, or the grant that allows it."""
    if prefixes:
        return f"use a URI under one of {list(prefixes)}, or add its prefix to {setting}"
    parts = urlsplit(uri)
    is_file = parts.scheme == "file"
    kind = "an object-store URI" if is_file else "a public storage URI"
    grant = local if is_file else f"{parts.scheme}://{parts.netloc}/"
    return (
        f'use {kind}, e.g. {example}, or allow it with {setting} = ["{grant}"] '
        f"(every {noun} must then be under a listed prefix)"
    )


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
