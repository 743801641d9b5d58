"""docker-compose.yml: it parses, and every command it runs exists with the flags it passes.

There is no Docker engine on the test machines, so the file is checked
statically: the services are there, the workers are the demo's fleet (the
producer waits for exactly those node names), the image copies paths that
exist, and each command line is run here with `--help` through the installed
console scripts, with every long and short option it uses found in that help.
The `monitoring` profile adds the exporter, Prometheus and Grafana, which start
only under that profile; every host path they mount exists.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from celery_ojs_ml.capabilities import resolve_capabilities
from celery_ojs_ml.demo.jobs import FLEET
from tests.helpers import ROOT

COMPOSE = ROOT / "docker-compose.yml"
BIN = Path(sys.executable).parent
WORKERS = ("worker-a100", "worker-l4", "worker-cpu")
MONITORING = ("exporter", "prometheus", "grafana")


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    found: dict[str, Any] = doc["services"]
    return found


def _verb_argv(command: list[str]) -> tuple[list[str], list[str]]:
    """The argv up to and including the verb, run through this venv's scripts; the rest."""
    program, rest = command[0], command[1:]
    argv = [str(BIN / program)]
    if program == "celery":
        at = rest.index("-A") + 2
        if rest[at] == "ojs-ml":  # `celery ojs-ml VERB`: the verb is the subcommand
            at += 1
        return argv + rest[: at + 1], rest[at + 1 :]
    return argv + rest[:1], rest[1:]


def _options(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("-")]


def test_the_file_defines_redis_flower_three_workers_and_a_producer(
    services: dict[str, Any],
) -> None:
    plain = {name for name, service in services.items() if "profiles" not in service}
    assert plain == {"redis", "flower", *WORKERS, "producer"}
    assert services["redis"]["image"].startswith("redis:")
    assert services["flower"]["ports"] == ["5555:5555"]
    assert set(services["producer"]["depends_on"]) == {"redis", *WORKERS}


def test_the_workers_are_the_demo_fleet_the_producer_waits_for(services: dict[str, Any]) -> None:
    fleet = {}
    for name in WORKERS:
        command = services[name]["command"]
        host = command[command.index("-n") + 1]
        capabilities = next(a for a in command if a.startswith("--ojs-ml-capabilities="))
        fleet[host] = capabilities.split("=", 1)[1]
        assert command[command.index("-P") + 1] == "prefork"  # GPU pinning needs prefork
    assert fleet == FLEET
    for value in fleet.values():
        labels = resolve_capabilities(value).derived_labels()
        assert labels["profile"] == value.removeprefix("profile:")


def test_every_app_service_talks_to_the_compose_redis(services: dict[str, Any]) -> None:
    for name in ("flower", *WORKERS, "producer", "exporter"):
        assert services[name]["environment"]["OJS_DEMO_BROKER"] == "redis://redis:6379/0"
    assert "--external-workers" in services["producer"]["command"]


def test_the_image_copies_paths_that_exist(services: dict[str, Any]) -> None:
    dockerfile = services["producer"]["build"]["dockerfile_inline"]
    copies = [line.split()[1:-1] for line in dockerfile.splitlines() if line.startswith("COPY ")]
    sources = [src for srcs in copies for src in srcs]
    assert sources == ["pyproject.toml", "README.md", "celery_ojs_ml", "examples"]
    for src in sources:
        assert (ROOT / src).exists(), src


@pytest.mark.parametrize("service", ["producer", *WORKERS, "exporter"])
def test_each_command_exists_and_accepts_every_option_it_is_given(
    services: dict[str, Any], service: str
) -> None:
    argv, args = _verb_argv(services[service]["command"])
    env = {**os.environ, "OJS_DEMO_BROKER": "memory://"}
    done = subprocess.run(
        [*argv, "--help"], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    for option in _options(args):
        assert re.search(rf"(^|[\s,/]){re.escape(option)}([\s,=]|$)", done.stdout, re.M), option


def test_flower_runs_from_the_demo_app_and_knows_the_port_option(
    services: dict[str, Any],
) -> None:
    argv, args = _verb_argv(services["flower"]["command"])
    env = {**os.environ, "OJS_DEMO_BROKER": "memory://"}
    done = subprocess.run(
        [*argv, "--help"], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Web based tool for monitoring" in done.stdout
    import flower.options  # noqa: F401  (defines Flower's tornado options)
    from tornado.options import options

    assert _options(args) == ["--port"]
    assert "port" in options


def test_redis_keeps_an_append_only_file_synced_every_second(services: dict[str, Any]) -> None:
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "everysec"


def test_the_monitoring_profile_adds_the_exporter_prometheus_and_grafana_only_under_it(
    services: dict[str, Any],
) -> None:
    profiled = {name: s["profiles"] for name, s in services.items() if "profiles" in s}
    assert profiled == {name: ["monitoring"] for name in MONITORING}
    assert services["exporter"]["image"] == services["producer"]["image"]
    assert services["prometheus"]["depends_on"] == ["exporter"]
    assert services["grafana"]["depends_on"] == ["prometheus"]


@pytest.mark.parametrize("service", ["prometheus", "grafana"])
def test_the_monitoring_images_are_pinned_to_a_release(
    services: dict[str, Any], service: str
) -> None:
    image, _, tag = services[service]["image"].partition(":")
    assert image in {"prom/prometheus", "grafana/grafana"}
    assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{service} image tag {tag!r} is not a release"


def test_every_host_path_a_service_mounts_exists(services: dict[str, Any]) -> None:
    mounts = [v.split(":")[0] for s in services.values() for v in s.get("volumes", [])]
    assert mounts, "the monitoring profile mounts its configuration"
    for source in mounts:
        assert source.startswith("./"), f"{source}: mount a path of this repository"
        assert (ROOT / source).exists(), source
