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


def _probe(spec: dict) -> str:
    test = spec["healthcheck"]["test"]
    assert test[0] in ("CMD", "CMD-SHELL"), test
    return " ".join(test[1:])


def test_serve_and_workers_have_healthchecks():
    svcs = services()
    serve_port = svcs["serve"]["command"][svcs["serve"]["command"].index("--port") + 1]
    assert f"http://127.0.0.1:{serve_port}/health" in _probe(svcs["serve"])
    assert any(p.endswith(f":{serve_port}") for p in svcs["serve"]["ports"])
    workers = [svcs["worker"], services(FILES[1])["worker-tp2"]]
    for w in workers:
        port = w["environment"]["PAGEDQ_METRICS_PORT"]
        assert f"http://127.0.0.1:{port}/metrics" in _probe(w)
        # The metrics port opens after the engine is up: a first-start kernel build must fit in the start period.
        assert _seconds(w["healthcheck"]["start_period"]) >= 300
    assert "redis-cli" in _probe(svcs["redis"])


def _seconds(text: str) -> int:
    m = re.fullmatch(r"(\d+)(s|m)", text)
    assert m, text
    return int(m[1]) * (60 if m[2] == "m" else 1)


def test_plain_up_starts_only_what_serves_jobs():
    svcs = services()
    for name in ("prometheus", "grafana"):
        assert svcs[name].get("profiles") == ["monitoring"], name
    assert [n for n, s in svcs.items() if "profiles" not in s] == ["redis", *PAGEDQ]


def test_redis_needs_a_password_that_is_never_defaulted():
    """The password comes from the environment or .env only: required (`:?`), never a default in the file, so
    Redis can neither run open nor with a password anyone can read here."""
    required = "${REDIS_PASSWORD:?"
    redis = services()["redis"]
    cmd = redis["command"]
    assert cmd[cmd.index("--requirepass") + 1].startswith(required)
    assert redis["environment"]["REDISCLI_AUTH"].startswith(required)
    for name in FILES:
        text = (ROOT / name).read_text()
        assert not re.search(r"\$\{REDIS_PASSWORD(:?-|-)", text), name
        for svc, spec in services(name).items():
            url = (spec.get("environment") or {}).get("REDIS_URL")
            if (spec.get("command") or [""])[0] == "pagedq" and svc != "models":
                assert url and url.startswith("redis://:" + required) and url.endswith("@redis:6379/0"), (name, svc)


def test_serve_takes_its_api_keys_from_the_environment():
    env = services()["serve"]["environment"]
    assert env["PAGEDQ_API_KEYS"] == "${PAGEDQ_API_KEYS:-}"


def test_every_pagedq_setting_is_an_option_of_its_command():
    """A misspelt PAGEDQ_* variable would be ignored silently by the container: each must be one its command reads."""
    for name in FILES:
        for svc, spec in services(name).items():
            cmd = spec.get("command") or []
            if not cmd or cmd[0] != "pagedq":
                continue
            command = main.commands[cmd[1]]
            read = {v for p in command.params for v in _envvars(p)}
            for var in spec.get("environment") or {}:
                if var.startswith("PAGEDQ_") or var == "REDIS_URL":
                    assert var in read, (name, svc, var)


def _envvars(param) -> list[str]:
    envvar = getattr(param, "envvar", None)
    return [envvar] if isinstance(envvar, str) else list(envvar or [])


def test_every_variable_of_the_compose_files_is_documented():
    text = (ROOT / "docs/operations.md").read_text()
    docker = text[text.index("## Docker"):text.index("## Kubernetes")]
    used = {v for name in FILES for v in re.findall(r"\$\{([A-Z_]+)", (ROOT / name).read_text())}
    assert used and not {v for v in used if v not in docker}, sorted(v for v in used if v not in docker)
    assert "--profile monitoring" in docker


def test_the_gpu_file_keeps_in_step():
    """Every service of ours runs the CUDA image the GPU file builds, and worker-tp2 is set up like worker."""
    base, gpu = services(), services(FILES[1])
    tag = gpu["models"]["image"]
    assert "cu" in gpu["models"]["build"]["args"]["TORCH_INDEX_URL"]
    for name in PAGEDQ:
        assert gpu[name]["image"] == tag, name
    tp2, worker = gpu["worker-tp2"], base["worker"]
    assert tp2["image"] == tag
    for key in ("restart", "healthcheck", "stop_grace_period", "volumes", "depends_on"):
        assert tp2[key] == worker[key], key
    assert set(worker["environment"]) - {"PAGEDQ_MAX_NUM_SEQS"} <= set(tp2["environment"])
    assert tp2["environment"]["REDIS_URL"] == worker["environment"]["REDIS_URL"]


def _dockerfile() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def test_the_image_runs_as_a_user_that_owns_its_cache_and_kernels():
    steps = _dockerfile()
    users = [arg for op, arg in steps if op == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    env = " ".join(arg for op, arg in steps if op == "ENV")
    kernels = re.search(r"PAGEDQ_KERNELS_DIR=(\S+)", env)[1]
    chown = " ".join(arg for op, arg in steps if op == "RUN" and "chown" in arg)
    assert f"{users[-1]}:" in chown and "/cache" in chown and (kernels in chown or "/opt/pagedq" in chown), chown
    # The kernels are built as that user, after USER, so the folder it writes is its own.
    ops = [op for op, _ in steps]
    build = next(i for i, (op, arg) in enumerate(steps) if op == "RUN" and "kernels build" in arg)
    assert ops.index("USER") < build


def test_the_torch_index_is_a_build_argument_with_a_cpu_default():
    args = dict(arg.split("=", 1) for op, arg in _dockerfile() if op == "ARG" and "=" in arg)
    assert args["TORCH_INDEX_URL"].strip('"').endswith("/whl/cpu")
    install = next(arg for op, arg in _dockerfile() if op == "RUN" and "TORCH_SPEC" in arg)
    assert "--index-url" in install and "TORCH_INDEX_URL" in install
    build_args = dict(a.partition("=")[::2] for a in services()["models"]["build"]["args"])
    # `-`, not `:-`: TORCH_INDEX_URL set empty means "the pip index", as it does for `docker build`.
    assert build_args["TORCH_INDEX_URL"] == "${TORCH_INDEX_URL-" + args["TORCH_INDEX_URL"].strip('"') + "}"
    # pip's own settings pass through to the build, declared in the Dockerfile without a default (unset: PyPI).
    declared = {arg for op, arg in _dockerfile() if op == "ARG" and "=" not in arg}
    assert {"PIP_INDEX_URL", "PIP_FIND_LINKS"} <= declared & {a for a, v in build_args.items() if not v}


def test_dockerignore_keeps_history_environments_and_caches_out():
    lines = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()}
    for path in (".git", ".venv", "**/__pycache__", ".pytest_cache", ".ruff_cache", ".env", "bench/results"):
        assert path in lines, path
    # Nothing the image copies is left out.
    copied = {arg.split()[0] for op, arg in _dockerfile() if op == "COPY"}
    assert not copied & lines, copied & lines
