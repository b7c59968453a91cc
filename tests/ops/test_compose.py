"""docker-compose.yml: valid, and the commands its containers run are real commands of our CLI."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_is_valid():
    if not shutil.which("docker-compose"):
        pytest.skip("docker-compose is not installed")
    subprocess.run(["docker-compose", "config", "-q"], cwd=ROOT, check=True)


def test_container_commands_exist():
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("models", "worker", "dashboard"):
        cmd = services[name]["command"]
        assert cmd[0] == "pagedq"
        args = [a for a in cmd[1:] if not a.startswith("$")] + ["--help"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, (name, result.output)


def test_a_worker_that_exits_is_started_again():
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("redis", "worker", "dashboard"):
        assert services[name].get("restart") == "unless-stopped", name


def test_prometheus_and_grafana_files_are_wired():
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    mounts = [v.split(":")[0] for name in ("prometheus", "grafana") for v in services[name]["volumes"]]
    for path in mounts:
        assert (ROOT / path).exists(), path
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"][0]
    port = services["worker"]["environment"]["PAGEDQ_METRICS_PORT"]
    assert scrape["dns_sd_configs"][0]["names"] == ["worker"] and str(scrape["dns_sd_configs"][0]["port"]) == port
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    dash = json.loads((ROOT / "deploy/grafana/dashboards/pagedq.json").read_text())
    assert dash["panels"] and all(p["datasource"]["uid"] == uid for p in dash["panels"])


def test_every_metric_the_grafana_dashboard_queries_is_exported():
    """The names a worker's /metrics serves, from its own registry: the real-Prometheus test
    (tests/ops/test_prometheus.py) checks the same against scraped series where `prometheus` is installed."""
    pc = pytest.importorskip("prometheus_client")
    from worker.metrics import Metrics
    from worker.redis_server import free_port

    m = Metrics("q", port=free_port(), model="m")
    exported = {line.split("{")[0].split(" ")[0] for line in pc.generate_latest(m.registry).decode().splitlines()
                if line and not line.startswith("#")}
    dash = json.loads((ROOT / "deploy/grafana/dashboards/pagedq.json").read_text())
    queried = {n for p in dash["panels"] for t in p["targets"] for n in re.findall(r"\bpagedq_[a-z0-9_]+", t["expr"])}
    assert queried and not queried - exported, queried - exported
