"""The store's client from its URL and options (`store.connect`): Sentinel, plain, refused.

No server is needed: building a client connects nothing, so these read what the client
would connect to; tests/integration/test_sentinel.py runs the same clients against real
sentinels through a failover.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from redis.sentinel import SentinelConnectionPool

from celery_ojs_ml import OJSML
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.store.connect import Source, connect, masked, parse_sentinel_url, source_of
from celery_ojs_ml.store.registry import OJSStore

URL = "sentinel://10.0.0.5:26379;sentinel://10.0.0.6:26380/2"


def _pool(client: Any) -> SentinelConnectionPool:
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    return pool


def test_a_sentinel_url_names_every_sentinel_and_the_database_of_the_last_one() -> None:
    parsed = parse_sentinel_url(URL)

    assert parsed.sentinels == [("10.0.0.5", 26379), ("10.0.0.6", 26380)]
    assert parsed.db == 2


def test_a_sentinel_without_a_port_listens_on_26379_and_the_database_defaults_to_0() -> None:
    parsed = parse_sentinel_url("sentinel://sentinel-a;sentinel://sentinel-b")

    assert parsed.sentinels == [("sentinel-a", 26379), ("sentinel-b", 26379)]
    assert parsed.db == 0


def test_the_database_and_password_in_the_first_url_count_as_kombu_reads_them() -> None:
    parsed = parse_sentinel_url("sentinel://:s3cret@10.0.0.5:26379/3;sentinel://10.0.0.6")

    assert (parsed.db, parsed.password, parsed.username) == (3, "s3cret", None)


def test_sentinel_urls_that_name_different_databases_are_refused() -> None:
    with pytest.raises(ConfigError, match="different dbs"):
        parse_sentinel_url("sentinel://a:1/1;sentinel://b:2/2")


def test_a_part_that_is_not_a_sentinel_address_is_refused_with_the_form_to_use() -> None:
    with pytest.raises(ConfigError) as info:
        parse_sentinel_url("sentinel://a:1;redis://b:2")

    assert "redis://b:2 is not a sentinel address" in str(info.value)
    assert "sentinel://10.0.0.5:26379;sentinel://10.0.0.6:26379/2" in str(info.value)


def test_a_sentinel_store_asks_the_sentinels_for_the_master_named_in_the_options() -> None:
    client = connect(Source(URL, {"master_name": "mymaster", "password": "pw"}))

    pool = _pool(client)
    assert pool.service_name == "mymaster" and pool.is_master
    ports = [s.connection_pool.connection_kwargs["port"] for s in pool.sentinel_manager.sentinels]
    assert ports == [26379, 26380]
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["password"], kwargs["socket_timeout"]) == (2, "pw", 10.0)


def test_sentinel_kwargs_reach_the_sentinels_with_the_store_timeouts_unless_given() -> None:
    options = {"master_name": "m", "sentinel_kwargs": {"password": "sp", "socket_timeout": 1}}

    pool = _pool(connect(Source(URL, options)))

    sentinel = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
    assert (sentinel["password"], sentinel["socket_timeout"]) == ("sp", 1)
    assert sentinel["socket_connect_timeout"] == 5.0


def test_a_sentinel_url_without_master_name_names_the_option_and_shows_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        connect(Source(URL, {}))

    message = str(info.value)
    assert message.startswith('ojs_ml_store_transport_options["master_name"] is None')
    assert 'app.conf.ojs_ml_store_transport_options = {"master_name": "mymaster"' in message


def test_an_unknown_store_option_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        connect(Source(URL, {"master_name": "m", "visibility_timeout": 10}))

    assert "unknown ojs_ml_store_transport_options ['visibility_timeout']" in str(info.value)
    assert "'master_name'" in str(info.value)


def test_sentinel_options_on_a_plain_redis_url_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"\['master_name'\] are only for sentinel:// store"):
        connect(Source("redis://127.0.0.1:7000/0", {"master_name": "m"}))


def test_connection_options_apply_to_a_plain_redis_url_too() -> None:
    client = connect(Source("redis://127.0.0.1:7000/1", {"socket_timeout": 3, "client_name": "x"}))

    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["port"], kwargs["db"], kwargs["socket_timeout"]) == (7000, 1, 3)
    assert kwargs["client_name"] == "x"


def test_a_redis_cluster_url_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError) as info:
        connect(Source("redis+cluster://127.0.0.1:7000"))

    message = str(info.value)
    assert "cannot be a Redis Cluster" in message and "docs/operations.md" in message


def test_ssl_options_make_tls_connections_to_the_data_nodes() -> None:
    options = {"master_name": "m", "ssl": {"ssl_ca_certs": "/etc/redis/ca.crt"}}

    pool = _pool(connect(Source(URL, options)))

    assert pool.connection_class.__name__ == "SentinelManagedSSLConnection"
    assert pool.connection_kwargs["ssl_ca_certs"] == "/etc/redis/ca.crt"


def test_without_a_store_url_a_sentinel_broker_lends_its_url_and_transport_options() -> None:
    broker_options = {"master_name": "mymaster", "visibility_timeout": 3600}

    source = source_of(None, {}, URL, broker_options)

    assert source == Source(URL, {"master_name": "mymaster"}, "broker_transport_options")


def test_without_a_store_url_a_plain_redis_broker_is_the_store_and_rabbitmq_is_not() -> None:
    assert source_of(None, {}, "redis://h:6380/0", {"x": 1}) == Source("redis://h:6380/0")
    assert source_of(None, {}, "amqp://guest@h//") is None


def test_a_store_url_equal_to_the_sentinel_broker_url_takes_the_broker_options() -> None:
    source = source_of(URL, {}, URL, {"master_name": "mymaster"})

    assert source is not None and source.options == {"master_name": "mymaster"}


def test_every_password_of_a_sentinel_url_is_masked() -> None:
    url = "sentinel://:pw1@a:1;sentinel://u:pw2@b:2/0"

    assert masked(url) == "sentinel://:***@a:1;sentinel://u:***@b:2/0"


def test_the_plugin_builds_its_store_on_the_sentinel_broker_when_no_store_url_is_set() -> None:
    app = Celery("t", broker=URL, set_as_current=False)
    app.conf.broker_transport_options = {"master_name": "mymaster", "visibility_timeout": 60}
    plugin = OJSML(app)

    store = plugin.store

    assert isinstance(store, OJSStore) and _pool(store.client).service_name == "mymaster"
    assert plugin.store_url() == URL


def test_the_plugin_names_broker_transport_options_when_the_sentinel_broker_has_no_master() -> None:
    app = Celery("t", broker=URL, set_as_current=False)
    plugin = OJSML(app)

    with pytest.raises(ConfigError, match=r'^broker_transport_options\["master_name"\] is None'):
        _ = plugin.store


def test_the_plugin_waits_for_the_replicas_its_settings_ask_for() -> None:
    app = Celery("t", broker="memory://", set_as_current=False)
    app.conf.ojs_ml_store_url = URL
    app.conf.ojs_ml_store_transport_options = {"master_name": "mymaster"}
    app.conf.ojs_ml_store_wait_replicas = 1
    app.conf.ojs_ml_store_wait_timeout_ms = 250

    store = OJSML(app).store

    assert (store.replicas, store.replica_wait_ms) == (1, 250)
