"""docker-compose.yml (and docker-compose.gpu.yml, the Dockerfile, .dockerignore): valid, the commands its containers
run are real commands of our CLI, and the file is production-sane as written: restart policies, healthchecks, ports
on 127.0.0.1 unless told otherwise, a required Redis password, monitoring only in its profile, a non-root image."""

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main

ROOT = Path(__file__).resolve().parents[2]


FILES = ("docker-compose.yml", "docker-compose.gpu.yml")
PAGEDQ = ("models", "worker", "serve", "dashboard")  # the services that run our image
LONG_RUNNING = ("redis", "worker", "serve", "dashboard")


def services(name: str = "docker-compose.yml") -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / name).read_text())["services"]


def compose_config(*files: str, **env: str) -> subprocess.CompletedProcess:
    """`docker-compose config` of FILES with ENV as the only settings (no .env of the checkout's user)."""
    if not shutil.which("docker-compose"):
        pytest.skip("docker-compose is not installed")
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME")}
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp, "env")
        empty.write_text("")
        args = ["docker-compose", "--project-directory", str(ROOT), "--env-file", str(empty)]
        for f in files:
            args += ["-f", str(ROOT / f)]
        return subprocess.run(args + ["config"], cwd=ROOT, env={**base, **env}, capture_output=True, text=True)


def test_compose_file_is_valid():
    for files in (FILES[:1], FILES):
        done = compose_config(*files, REDIS_PASSWORD="s3cret")
        assert done.returncode == 0, done.stderr


def test_compose_refuses_to_start_without_a_redis_password():
    done = compose_config(FILES[0])
    assert done.returncode != 0 and "REDIS_PASSWORD" in done.stderr, done.stderr


def test_published_ports_stay_on_this_host_unless_told():
    import yaml

    def bound(**env: str) -> set[str]:
        done = compose_config(*FILES, REDIS_PASSWORD="s3cret", **env)
        assert done.returncode == 0, done.stderr
        svcs = yaml.safe_load(done.stdout)["services"]
        return {p.rsplit(":", 2)[0] if isinstance(p, str) else p["host_ip"]
                for s in svcs.values() for p in s.get("ports", [])}

    assert bound() == {"127.0.0.1"}
    assert bound(PAGEDQ_BIND="0.0.0.0") == {"0.0.0.0"}


def test_every_published_port_is_bound_to_pagedq_bind():
    for name in FILES:
        for svc, spec in services(name).items():
            for port in spec.get("ports", []):
                assert port.startswith("${PAGEDQ_BIND:-127.0.0.1}:"), (name, svc, port)


def test_container_commands_exist():
    svcs = services()
    for name in PAGEDQ:
        cmd = svcs[name]["command"]
        assert cmd[0] == "pagedq"
        args = [a for a in cmd[1:] if not a.startswith("$")] + ["--help"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, (name, result.output)


def test_a_worker_that_exits_is_started_again():
    svcs = services()
    for name in LONG_RUNNING:
        assert svcs[name].get("restart") == "unless-stopped", name
    assert services(FILES[1])["worker-tp2"]["restart"] == "unless-stopped"


def test_prometheus_and_grafana_files_are_wired():
    yaml = pytest.importorskip("yaml")
    services_ = services()
    mounts = [v.split(":")[0] for name in ("prometheus", "grafana") for v in services_[name]["volumes"]]
    for path in mounts:
        assert (ROOT / path).exists(), path
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"][0]
    port = services_["worker"]["environment"]["PAGEDQ_METRICS_PORT"]
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
