"""deploy/monitoring: the Grafana dashboard asks only for what the exporter exports.

Every PromQL expression on the dashboard (panel targets and template variables)
is read for the metric names it selects, and each must be a family from
`celery_ojs_ml.exporter.metric_names()`, or a histogram family with its
`_bucket`/`_sum`/`_count` suffix. The dashboard is checked as Grafana reads it
(unique panel ids, grid positions that fit and do not overlap, a data source and
a query on every panel), and the Prometheus and Grafana provisioning files are
checked against docker-compose.yml: Prometheus scrapes the `exporter` service on
the port its command serves, Grafana reads Prometheus and the dashboards from
where compose mounts them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.helpers import ROOT

DEPLOY = ROOT / "deploy" / "monitoring"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "ojs-ml.json"
PROMETHEUS = DEPLOY / "prometheus.yml"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "ojs-ml.yml"
COMPOSE = ROOT / "docker-compose.yml"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range", "__interval_ms"}

# PromQL words that look like metric names: binary operators, modifiers, literals.
KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
    | {"group_left", "group_right", "atan2", "inf", "nan"}
)
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:$])([A-Za-z_:][\w:]*)(\s*\()?")
_LABEL_VALUES = re.compile(r"^label_values\(\s*(?:(?P<selector>.+),\s*)?(?P<label>\w+)\s*\)$")


def metric_names_in(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, labels and keywords removed)."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    found = set()
    for match in _IDENTIFIER.finditer(text):
        name, call = match.group(1), match.group(2)
        if not call and name.lower() not in KEYWORDS:
            found.add(name)
    return found


def _exports(name: str, exported: frozenset[str]) -> bool:
    if name in exported:
        return True
    stem = next((name.removesuffix(s) for s in HISTOGRAM_SERIES if name.endswith(s)), None)
    return stem is not None and stem in exported


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    found: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return found


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]
    return found


@pytest.fixture(scope="module")
def exported() -> frozenset[str]:
    from celery_ojs_ml.exporter import metric_names

    return metric_names()


@pytest.fixture(scope="module")
def families(exported: frozenset[str]) -> dict[str, Any]:
    """Family name -> the exporter's catalogue entry (kind and label names)."""
    from celery_ojs_ml.exporter import names

    found = {f.name: f for f in (*names.GAUGES, *names.EVENTS)}
    assert set(found) == exported
    return found


@pytest.fixture(scope="module")
def kinds(families: dict[str, Any]) -> dict[str, str]:
    """Family name -> "gauge", "counter" or "histogram"."""
    return {name: f.kind for name, f in families.items()}


def labels_in(expr: str, legend: str = "") -> set[str]:
    """The label names a PromQL expression matches or groups on, and those its legend shows."""
    text = _STRINGS.sub('""', expr)
    found = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
    for block in re.findall(r"\{([^}]*)\}", text):
        found.update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", block))
    for block in _GROUPING.findall(text):
        found.update(re.findall(r"\w+", block.partition("(")[2]))
    return found


def _queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for where, expr, _ in _labelled_queries(dashboard):
        yield where, expr


def _labelled_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(where, PromQL, legend or variable label) for every target and query variable."""
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            where = f"panel {panel['title']!r} target {target['refId']}"
            yield where, target["expr"], target.get("legendFormat", "")
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = _LABEL_VALUES.match(text.strip())
        assert match and match["selector"], f"variable {variable['name']}: {text!r}"
        yield f"variable {variable['name']!r}", match["selector"], f"{{{{{match['label']}}}}}"


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that queries, including those inside collapsed rows."""
    found = []
    for panel in dashboard["panels"]:
        found.extend(panel.get("panels", []))
        if panel["type"] != "row":
            found.append(panel)
    return found


def _option(command: list[str], name: str) -> str:
    at = command.index(name)
    return command[at + 1]


def _mount(service: dict[str, Any], host: str) -> str:
    """The container path where `service` mounts the repository path `host`."""
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        if (ROOT / source).resolve() == (ROOT / host).resolve():
            return target
    raise AssertionError(f"{host} is not mounted: {service['volumes']}")


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            "histogram_quantile(0.95, sum by (band, le) "
            "(rate(ojs_ml_job_wait_seconds_bucket[$__rate_interval])))",
            {"ojs_ml_job_wait_seconds_bucket"},
        ),
        ('sum by (queue) (ojs_ml_jobs{state="pending", queue=~"$queue"})', {"ojs_ml_jobs"}),
        ("60 * sum(rate(a_total{q='x y'}[5m] offset 1h)) > bool 1e3", {"a_total"}),
        ("a / on(worker) group_left(gpu_type) b unless c", {"a", "b", "c"}),
        ("max by (leader) (ojs_ml_leader) == 1", {"ojs_ml_leader"}),
        ("vector(1) and time()", set()),
    ],
)
def test_the_promql_reader_finds_metric_names_and_nothing_else(expr: str, names: set[str]) -> None:
    assert metric_names_in(expr) == names


def test_the_label_reader_finds_matchers_groupings_and_legend_labels() -> None:
    expr = 'sum by (band, le) (rate(x_bucket{state="a,b", queue=~"$queue"}[5m])) / on(worker) y'
    assert labels_in(expr, "{{band}} p95") == {"band", "le", "state", "queue", "worker"}


def test_every_dashboard_query_names_only_metrics_the_exporter_exports(
    dashboard: dict[str, Any], exported: frozenset[str]
) -> None:
    unknown = {}
    for where, expr in _queries(dashboard):
        assert "__name__" not in expr, f"{where}: select metrics by name, not by __name__"
        names = metric_names_in(expr)
        assert names, f"{where}: {expr!r} selects no metric"
        if missing := sorted(n for n in names if not _exports(n, exported)):
            unknown[where] = missing
    assert unknown == {}, f"not exported by celery_ojs_ml.exporter: {unknown}"


def test_every_exported_metric_has_a_panel(
    dashboard: dict[str, Any], exported: frozenset[str]
) -> None:
    shown = {n for _, expr in _queries(dashboard) for n in metric_names_in(expr)}
    shown |= {n.removesuffix(s) for n in shown for s in HISTOGRAM_SERIES if n.endswith(s)}
    assert sorted(exported - shown) == []


def test_counters_and_histogram_buckets_are_read_through_rate(
    dashboard: dict[str, Any], kinds: dict[str, str]
) -> None:
    for where, expr in _queries(dashboard):
        for name in metric_names_in(expr):
            stem = name.removesuffix("_bucket")
            if stem != name:
                assert kinds.get(stem) == "histogram", f"{where}: {stem} is not a histogram"
            if stem != name or kinds.get(name) == "counter":
                uses = len(re.findall(rf"\b{name}\b", expr))
                rated = len(re.findall(rf"\b(?:rate|irate|increase)\(\s*{name}\b", expr))
                assert uses == rated, f"{where}: read {name} through rate() or increase()"


def test_every_label_a_query_matches_groups_or_shows_is_one_its_metrics_carry(
    dashboard: dict[str, Any], families: dict[str, Any]
) -> None:
    for where, expr, legend in _labelled_queries(dashboard):
        carried = set()
        for name in metric_names_in(expr):
            family = families[name.removesuffix("_bucket")]
            carried |= set(family.labels) | ({"le"} if name.endswith("_bucket") else set())
        used = labels_in(expr, legend)
        assert used <= carried, f"{where}: {sorted(used - carried)} not among {sorted(carried)}"


def test_the_dashboard_is_a_grafana_dashboard_with_unique_panel_ids_and_positions(
    dashboard: dict[str, Any],
) -> None:
    assert dashboard["uid"] == "ojs-ml"
    assert dashboard["schemaVersion"] >= 36  # the datasource-object form of Grafana 9+
    ids = [p["id"] for p in dashboard["panels"]] + [
        p["id"] for row in dashboard["panels"] for p in row.get("panels", [])
    ]
    assert all(isinstance(i, int) for i in ids)
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert set(grid) == {"x", "y", "w", "h"}, panel["title"]
        assert grid["x"] >= 0 and grid["y"] >= 0 and grid["w"] > 0 and grid["h"] > 0
        assert grid["x"] + grid["w"] <= 24, f"{panel['title']!r} is wider than the grid"
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                other = cells.setdefault((x, y), panel["title"])
                assert other == panel["title"], f"{panel['title']!r} overlaps {other!r}"


def test_every_panel_queries_the_datasource_variable_with_a_non_empty_expr(
    dashboard: dict[str, Any],
) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = _panels(dashboard)
    assert len(panels) >= 20
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']!r} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), f"{panel['title']!r} has an empty query"


def test_every_variable_a_query_uses_is_defined(dashboard: dict[str, Any]) -> None:
    defined = {v["name"] for v in dashboard["templating"]["list"]} | GRAFANA_VARIABLES
    for where, expr in _queries(dashboard):
        used = set(re.findall(r"\$\{?(\w+)", expr))
        assert used <= defined, f"{where} uses undefined {sorted(used - defined)}"


def test_prometheus_scrapes_the_exporter_service_on_the_port_it_serves(
    services: dict[str, Any],
) -> None:
    config = yaml.safe_load(PROMETHEUS.read_text(encoding="utf-8"))
    [job] = config["scrape_configs"]
    [static] = job["static_configs"]
    command = services["exporter"]["command"]
    assert command[command.index("ojs-ml") + 1] == "metrics"
    assert _option(command, "--address") == "0.0.0.0"  # reachable from the prometheus container
    assert static["targets"] == [f"exporter:{_option(command, '--port')}"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    mount = _mount(services["prometheus"], "deploy/monitoring/prometheus.yml")
    assert mount == "/etc/prometheus/prometheus.yml"  # the image's default --config.file


def test_grafana_reads_the_compose_prometheus_and_the_mounted_dashboards(
    services: dict[str, Any],
) -> None:
    [source] = yaml.safe_load(DATASOURCES.read_text(encoding="utf-8"))["datasources"]
    assert (source["type"], source["url"], source["isDefault"]) == (
        "prometheus",
        "http://prometheus:9090",
        True,
    )
    assert "prometheus" in services
    grafana = services["grafana"]
    assert _mount(grafana, "deploy/monitoring/grafana/provisioning") == "/etc/grafana/provisioning"
    dashboards = _mount(grafana, "deploy/monitoring/grafana/dashboards")
    [provider] = yaml.safe_load(PROVIDERS.read_text(encoding="utf-8"))["providers"]
    assert provider["options"]["path"] == dashboards
    home = PurePosixPath(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home.parent == PurePosixPath(dashboards)
    assert (DASHBOARD.parent / home.name) == DASHBOARD


def test_the_provisioning_files_sit_where_grafana_looks_for_them() -> None:
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert sorted(str(p.relative_to(provisioning)) for p in provisioning.rglob("*.yml")) == [
        str(Path("dashboards") / "ojs-ml.yml"),
        str(Path("datasources") / "prometheus.yml"),
    ]
    for path in (DATASOURCES, PROVIDERS):
        assert yaml.safe_load(path.read_text(encoding="utf-8"))["apiVersion"] == 1
