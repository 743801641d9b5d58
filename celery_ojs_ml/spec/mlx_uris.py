"""The checker of `ext_mlx_*` URI attributes, all artifact URIs (OJS ML Extensions §6, §12).

Key decision: a URI's reach is checked against the operator's prefixes
(`spec/uris.py`) only once its scheme is allowed and it is safe (no
credentials, no `..`, a local absolute path for `file:`). The only rewrite is
lower-casing the scheme, so checking its own output changes nothing.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from typing import Any
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from celery_ojs_ml.spec import uris
from celery_ojs_ml.spec.mlx_checkers import (
    NO_SECRETS,
    Checker,
    Collector,
    is_credential_name,
    show,
    wrong_type,
)

_URI_EXAMPLE = '"s3://bucket/models/v1.0/model.safetensors"'
_LOCAL = 'use a local absolute path, e.g. "file:///data/models/v1.0/"'
_SCHEMES_SETTING = "app.conf.ojs_ml_artifact_schemes"
_PREFIXES_SETTING = "app.conf.ojs_ml_artifact_prefixes"


def artifact_uri(section: str) -> Checker:
    def check(path: str, value: Any, c: Collector) -> Any:
        if not isinstance(value, str):
            wrong_type(c, path, value, "a URI string", section, _URI_EXAMPLE)
            return value
        return _check_uri(path, value, c)

    return check


def _check_uri(path: str, uri: str, c: Collector) -> str:
    parts, problem = _parse_uri(uri)
    if parts is None:
        c.fail(path, problem, "§6", f"write an absolute URI, e.g. {_URI_EXAMPLE}")
        return uri
    scheme = parts.scheme.lower()
    normalised = scheme + uri[len(parts.scheme) :]
    allowed = scheme in c.schemes
    if not allowed:
        names = ", ".join(sorted(c.schemes)) or "none"
        problem = f"uses scheme {show(scheme)}, which is not allowed (allowed: {names})"
        fix = f"use an allowed scheme, e.g. {_URI_EXAMPLE}, or add it to {_SCHEMES_SETTING}"
        c.fail(path, problem, "§12.1", fix)
    unsafe = list(_uri_safety_problems(parts, scheme))
    for problem, section, fix in unsafe:
        c.fail(path, problem, section, fix)
    if allowed and not unsafe:
        _check_reach(path, normalised, c)
    return normalised


def _check_reach(path: str, uri: str, c: Collector) -> None:
    """§12.1: no arbitrary file system access, and no internal hosts, unless a prefix allows."""
    problem = uris.reach_problem(uri, c.prefixes)
    if problem is None:
        return
    fix = uris.reach_fix(
        uri, c.prefixes, _PREFIXES_SETTING, _URI_EXAMPLE, "file:///data/artifacts/", "artifact URI"
    )
    c.fail(path, f"{uri!r} {problem}", "§12.1", fix)


def _parse_uri(uri: str) -> tuple[SplitResult | None, str]:
    bad = next((ch for ch in uri + _decoded(uri) if _is_unsafe_char(ch)), None)
    if bad is not None:
        return None, f"contains whitespace or control character {show(bad)}"
    try:
        parts = urlsplit(uri)
    except ValueError as exc:
        return None, f"is not a valid URI ({exc})"
    return (parts, "") if parts.scheme else (None, f"{show(uri)} has no scheme")


def _is_unsafe_char(ch: str) -> bool:
    return ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf", "Cs")


def _decoded(text: str) -> str:
    """Undo percent-encoding until stable, so `%252e%252e` is seen as `..` too."""
    for _ in range(4):
        text, previous = unquote(text), text
        if text == previous:
            break
    return text


def _uri_safety_problems(parts: SplitResult, scheme: str) -> Iterator[tuple[str, str, str]]:
    if "@" in parts.netloc:
        yield "embeds credentials (user info before @)", "§12.4", NO_SECRETS
    for name, _ in parse_qsl(parts.query, keep_blank_values=True):
        if is_credential_name(name):
            yield f"carries credential query parameter {show(name)}", "§12.4", NO_SECRETS
    if ".." in re.split(r"[/\\]", _decoded(parts.netloc + parts.path)):
        yield "has a '..' segment (path traversal)", "§12.1", f"drop it, e.g. {_URI_EXAMPLE}"
    if scheme == "file" and parts.netloc.lower() not in ("", "localhost"):
        yield f"names host {show(parts.netloc)}; file URIs must be local", "§12.1", _LOCAL
    if scheme == "file" and not parts.path.startswith("/"):
        yield "is not an absolute file path", "§12.1", _LOCAL
