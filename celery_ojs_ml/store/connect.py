"""The store's Redis client, made in one place from its URL and transport options.

Responsibility: turn `ojs_ml_store_url` and `ojs_ml_store_transport_options` (else the
broker's URL and `broker_transport_options`) into a redis-py client with the timeouts
the store needs. Every store client is made here (`OJSStore.from_url`).

Key decisions:
* A `sentinel://` URL is read as kombu's Redis Sentinel transport reads `broker_url`:
  sentinels separated by `;`, each `sentinel://[user:password@]host[:26379][/db]`, and
  `master_name` (required) from the transport options. kombu takes the database and
  the password from the first URL only; here any one URL may carry them, and URLs that
  disagree are refused rather than one silently winning.
* The client is redis-py's `Sentinel.master_for`: every new connection asks the
  sentinels for the current primary, and a connection whose server was demoted
  (READONLY) is dropped and made again, so after a failover every call, with redis-py's
  retries, reaches the new primary.
* A store on the broker's sentinel URL takes its options from `broker_transport_options`
  (and TLS from `broker_use_ssl`); the kombu-only options there are ignored. An unknown
  key in `ojs_ml_store_transport_options` fails at start-up with the valid ones.
* Redis Cluster is refused with the reason (docs/operations.md, "Redis Cluster").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
from redis.sentinel import Sentinel

from celery_ojs_ml.errors import ConfigError

SETTING = "ojs_ml_store_transport_options"
BROKER_SETTING = "broker_transport_options"
CONNECT_TIMEOUT_S = 5.0
SOCKET_TIMEOUT_S = 10.0
"""A store that stops answering fails the call instead of hanging a producer or a timer."""
SENTINEL_PORT = 26379
PLAIN_SCHEMES = ("redis://", "rediss://", "unix://")
CONNECTION_KEYS = frozenset(
    {
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "socket_keepalive_options",
        "health_check_interval",
        "retry_on_timeout",
        "max_connections",
        "client_name",
        "username",
        "password",
    }
)
"""Options for the data nodes, as redis-py's client takes them."""
SENTINEL_KEYS = frozenset({"master_name", "sentinel_kwargs", "min_other_sentinels", "ssl"})
"""Options only a `sentinel://` URL takes (kombu's SentinelChannel, plus `ssl`)."""
_EXAMPLE = '{"master_name": "mymaster", "sentinel_kwargs": {"password": "..."}}'


@dataclass(frozen=True)
class Source:
    """Where the store is: its URL, its options, and the setting they came from."""

    url: str
    options: Mapping[str, Any] = field(default_factory=dict)
    origin: str = SETTING
    """The setting named in error messages about `options`."""


@dataclass(frozen=True)
class SentinelURL:
    """A parsed `sentinel://...;sentinel://...` URL."""

    sentinels: list[tuple[str, int]]
    db: int
    username: str | None
    password: str | None


def source_of(
    store_url: str | None,
    store_options: Mapping[str, Any] | None,
    broker_url: str | None,
    broker_options: Mapping[str, Any] | None = None,
    broker_ssl: Any = None,
) -> Source | None:
    """The store's `Source`: `ojs_ml_store_url`, else the broker's URL when that is Redis
    (plain or Sentinel); None when neither."""
    broker = str(broker_url or "")
    if store_url:
        if not store_options and store_url == broker and broker.startswith("sentinel://"):
            return _broker_source(broker, broker_options, broker_ssl)
        return Source(store_url, dict(store_options or {}))
    if broker.startswith(PLAIN_SCHEMES):
        return Source(broker)
    if broker.startswith("sentinel://"):
        return _broker_source(broker, broker_options, broker_ssl)
    return None


def _broker_source(url: str, options: Mapping[str, Any] | None, ssl: Any) -> Source:
    known = CONNECTION_KEYS | SENTINEL_KEYS
    picked = {k: v for k, v in (options or {}).items() if k in known}
    if ssl:
        picked["ssl"] = ssl
    return Source(url, picked, BROKER_SETTING)


def connect(source: Source) -> redis.Redis:
    """A redis-py client for `source` (a new connection pool)."""
    url = source.url
    if url.startswith(("redis+cluster://", "rediss+cluster://", "cluster://")):
        raise ConfigError(
            f"the store cannot be a Redis Cluster ({masked(url)}): the leader's pipelined "
            "scripts and transactions need one server (docs/operations.md, 'Redis Cluster'); "
            'use one primary, with Sentinel for failover, e.g. "sentinel://10.0.0.5:26379"'
        )
    if url.startswith("sentinel://"):
        return _sentinel_client(source)
    _refuse(source, SENTINEL_KEYS)
    kwargs = _connection_kwargs(source)
    return redis.Redis.from_url(url, **kwargs)


def _sentinel_client(source: Source) -> redis.Redis:
    options = source.options
    _refuse(source)
    name = options.get("master_name")
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f'{source.origin}["master_name"] is {name!r}; a sentinel:// store URL needs the '
            "name the sentinels monitor the primary under, e.g. "
            f"app.conf.{source.origin} = {_EXAMPLE}"
        )
    parsed = parse_sentinel_url(source.url)
    kwargs = _connection_kwargs(source)
    for key, value in (("username", parsed.username), ("password", parsed.password)):
        if value is not None:
            kwargs.setdefault(key, value)
    kwargs.update(_ssl(source))
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        parsed.sentinels,
        min_other_sentinels=int(options.get("min_other_sentinels") or 0),
        sentinel_kwargs=_sentinel_kwargs(source),
    )
    client: redis.Redis = sentinel.master_for(name, db=parsed.db, **kwargs)  # type: ignore[no-untyped-call]
    return client


def _connection_kwargs(source: Source) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
    }
    kwargs.update({k: v for k, v in source.options.items() if k in CONNECTION_KEYS})
    return kwargs


def _sentinel_kwargs(source: Source) -> dict[str, Any]:
    """The sentinels' own connection options: the store's timeouts unless given."""
    given = source.options.get("sentinel_kwargs") or {}
    if not isinstance(given, Mapping):
        raise ConfigError(
            f'{source.origin}["sentinel_kwargs"] must be a dict of redis-py connection '
            f"options for the sentinels, e.g. {{'password': '...'}}, not {given!r}"
        )
    return {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
        **dict(given),
    }


def _ssl(source: Source) -> dict[str, Any]:
    """TLS to the data nodes: `ssl` True, or a dict of redis-py `ssl_*` options."""
    ssl = source.options.get("ssl")
    if not ssl:
        return {}
    if ssl is True:
        return {"ssl": True}
    bad = [k for k in ssl if not str(k).startswith("ssl_")] if isinstance(ssl, Mapping) else ssl
    if bad:
        raise ConfigError(
            f'{source.origin}["ssl"] must be True or a dict of redis-py ssl_* options, '
            f"e.g. {{'ssl_ca_certs': '/etc/redis/ca.crt'}}, not {ssl!r}"
        )
    return {"ssl": True, **dict(ssl)}


def _refuse(source: Source, sentinel_only: frozenset[str] = frozenset()) -> None:
    """Unknown options (and, for plain URLs, the sentinel ones) fail with the valid keys."""
    if source.origin != SETTING:
        return  # the broker's options: kombu's own keys are not ours to judge
    wrong = sorted(set(source.options) & sentinel_only)
    if wrong:
        raise ConfigError(
            f"{source.origin} {wrong} are only for sentinel:// store URLs, and the store URL "
            f"is {masked(source.url)}; remove them, or use a sentinel:// URL"
        )
    valid = CONNECTION_KEYS | SENTINEL_KEYS
    unknown = sorted(set(source.options) - valid)
    if unknown:
        raise ConfigError(f"unknown {source.origin} {unknown}; valid: {sorted(valid)}")


def parse_sentinel_url(url: str) -> SentinelURL:
    """`sentinel://[user:password@]host[:port][/db]`, one or more joined by `;`."""
    parts = [p.strip() for p in url.split(";") if p.strip()]
    sentinels: list[tuple[str, int]] = []
    found: dict[str, set[Any]] = {"db": set(), "username": set(), "password": set()}
    for part in parts:
        split = urlsplit(part)
        if split.scheme != "sentinel" or not split.hostname or split.query:
            raise ConfigError(
                f"{masked(part)} is not a sentinel address; write each sentinel as "
                "sentinel://host:port, joined by ';', with the database in the path and "
                'options in ojs_ml_store_transport_options, e.g. "sentinel://10.0.0.5:26379;'
                'sentinel://10.0.0.6:26379/2"'
            )
        sentinels.append((split.hostname, split.port or SENTINEL_PORT))
        path = split.path.strip("/")
        if path:
            found["db"].add(_db(path, part))
        if split.username:
            found["username"].add(unquote(split.username))
        if split.password is not None:
            found["password"].add(unquote(split.password))
    for what, values in found.items():
        if len(values) > 1:
            raise ConfigError(
                f"the sentinel URLs of {masked(url)} name different {what}s; give the "
                f"{what} once (kombu reads it from the first URL)"
            )
    return SentinelURL(
        sentinels,
        next(iter(found["db"]), 0),
        next(iter(found["username"]), None),
        next(iter(found["password"]), None),
    )


def _db(path: str, part: str) -> int:
    try:
        return int(path)
    except ValueError:
        raise ConfigError(
            f"{masked(part)}: the path must be a database number, e.g. /2, not /{path}"
        ) from None


def masked(url: str) -> str:
    """`url` with every password replaced by `***` (for messages and logs)."""
    return ";".join(_masked_one(part) for part in url.split(";"))


def _masked_one(url: str) -> str:
    parts = urlsplit(url)
    if not parts.password:
        return url
    host = parts.netloc.rsplit("@", 1)[-1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))
