"""deploy/kubernetes/: valid against the Kubernetes schemas, offline (kubernetes-validate ships them), and wired
to what pagedq really does: the worker's and serve's commands, ports and probes, the queue's streams and consumer
group, Redis's password from a Secret wherever Redis is reached (tried on a real redis-server), and pods that
run as the image's non-root user."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner

from cli import main
from producer.keys import GROUP, Keys

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
K8S_VERSION = "1.30.0"
REDIS_SECRET = {"name": "pagedq-redis", "key": "password"}
REDIS_UID = 999  # the official redis image's redis user
PASSWORD = secrets.token_hex(16)  # URL-safe, as docs/operations.md asks of the Secret's value
URL_VARS = ("REDIS_URL", "PAGEDQ_REDIS_URL")


def docs() -> list[dict]:
    yaml = pytest.importorskip("yaml")
    return [d for f in MANIFESTS for d in yaml.safe_load_all(f.read_text()) if d]


def by_kind(kind: str) -> list[dict]:
    return [d for d in docs() if d["kind"] == kind]


def named(kind: str, name: str) -> dict:
    (d,) = [d for d in by_kind(kind) if d["metadata"]["name"] == name]
    return d


def config() -> dict[str, str]:
    (cm,) = by_kind("ConfigMap")
    return cm["data"]


def pods() -> dict[str, dict]:
    """Every workload's pod spec, by the workload's name."""
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs()
            if d["kind"] in ("Deployment", "StatefulSet")}


def containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it in env values, command and args: a variable not defined stays as is."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def environment(c: dict, maps: dict[str, dict], secret: dict[str, dict]) -> dict[str, str]:
    """A container's environment as the kubelet makes it: envFrom first, then env in order, each value expanded
    with what is defined before it. A reference to a ConfigMap or Secret key that is not given raises KeyError."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        ref = e["valueFrom"]
        if "secretKeyRef" in ref:
            env[e["name"]] = secret[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
        else:
            env[e["name"]] = maps[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
    return env


def env_here(c: dict, address: str | None = None) -> dict[str, str]:
    """`environment` with the manifests' ConfigMap (Redis at `address`, if given) and a Redis password."""
    data = config() | ({"REDIS_ADDRESS": address} if address else {})
    return environment(c, {"pagedq-worker": data}, {REDIS_SECRET["name"]: {REDIS_SECRET["key"]: PASSWORD}})


def redis_container() -> dict:
    (c,) = pods()["redis"]["containers"]
    return c


def pagedq_containers() -> list[tuple[str, dict]]:
    """(workload, container) of every container running the pagedq image."""
    return [(name, c) for name, pod in pods().items() for c in containers(pod) if c["image"].startswith("pagedq")]


def check_cli(command: list[str]) -> None:
    """A container's command is a real `pagedq` command: its --help runs (options' values are not checked)."""
    args = [a for a in command[1:] if not a.startswith("$")] + ["--help"]
    assert command[0] == "pagedq" and CliRunner().invoke(main, args).exit_code == 0, command


def test_manifests_match_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (the dev extra has it)")
    checked = 0
    for d in docs():
        if d["apiVersion"].startswith("keda.sh/"):  # a CRD: no schema in the Kubernetes set (checked below)
            continue
        kv.validate(d, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 7 and {"Deployment", "StatefulSet", "Service", "ConfigMap"} <= {d["kind"] for d in docs()}


def test_worker_deployment_runs_real_commands_with_probes_and_a_drain():
    spec = pods()["pagedq-worker"]
    (worker,) = spec["containers"]
    env = env_here(worker)
    for c in containers(spec):
        check_cli(c["command"])
    port = int(env["PAGEDQ_METRICS_PORT"])
    assert {p["containerPort"] for p in worker["ports"]} == {port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"]["port"] in ("metrics", port), probe
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "kill -TERM 1" in " ".join(worker["lifecycle"]["preStop"]["exec"]["command"])
    assert spec["terminationGracePeriodSeconds"] > float(env["PAGEDQ_DRAIN_TIMEOUT"])
    # A worker that stops itself (its engine fails with no job to blame) is started again: a Deployment's pods
    # restart always, and no manifest may say otherwise.
    assert spec.get("restartPolicy", "Always") == "Always"


def test_keda_scales_the_worker_on_its_queue_signed_in_with_the_secret():
    (so,) = by_kind("ScaledObject")
    cm = config()
    assert so["spec"]["scaleTargetRef"]["name"] == "pagedq-worker"
    assert so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    triggers = so["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"redis-streams"}
    assert {t["metadata"]["stream"] for t in triggers} == set(Keys(cm["PAGEDQ_QUEUE"]).lane_streams())
    auths = {a["metadata"]["name"]: a["spec"] for a in by_kind("TriggerAuthentication")}
    for t in triggers:
        assert t["metadata"]["address"] == cm["REDIS_ADDRESS"]
        assert not {"password", "passwordFromEnv"} & set(t["metadata"]), "the password comes from the Secret"
        refs = auths[t["authenticationRef"]["name"]]["secretTargetRef"]
        assert {"parameter": "password", **REDIS_SECRET} in refs, t
    pending = [t for t in triggers if "pendingEntriesCount" in t["metadata"]]
    assert pending and all(t["metadata"]["consumerGroup"] == GROUP for t in pending)


def test_every_redis_address_carries_the_password_from_the_secret():
    for cm in by_kind("ConfigMap"):  # a URL with a password in it belongs in a Secret, not here
        assert not any("redis://" in v or "rediss://" in v for v in cm["data"].values()), cm["metadata"]["name"]
    users = 0
    for name, c in pagedq_containers():
        env = env_here(c)
        if c["command"][:2] in (["pagedq", "worker"], ["pagedq", "serve"]):
            assert "REDIS_URL" in env, f"{name}/{c['name']} reaches Redis without a REDIS_URL"
        for var in URL_VARS:
            if var in env:
                url = urlsplit(env[var])
                assert (url.password, url.netloc.split("@")[-1]) == (PASSWORD, config()["REDIS_ADDRESS"]), name
                users += 1
    assert users >= 3  # the worker, the tensor-parallel worker and serve
    redis = redis_container()
    env = env_here(redis)
    args = [expand(a, env) for a in redis["args"]]
    assert args[args.index("--requirepass") + 1] == PASSWORD
    assert env["REDISCLI_AUTH"] == PASSWORD, "the readiness probe's redis-cli signs in"


def test_the_manifests_passwords_open_a_real_redis():
    """Redis started with the StatefulSet's args, the workers' and serve's REDIS_URL and the readiness probe,
    all from one Secret value, on a real redis-server; without the password, Redis refuses."""
    import redis as redis_lib

    from worker.redis_server import RedisServer

    c = redis_container()
    args = [expand(a, env_here(c)) for a in c["args"][1:]]
    i = args.index("--dir")
    del args[i:i + 2]  # the pod's volume: here, the server's own folder
    with RedisServer(password=PASSWORD, args=args) as srv:
        address = f"127.0.0.1:{srv.port}"
        for name, pc in pagedq_containers():
            url = env_here(pc, address).get("REDIS_URL")
            if url:
                with redis_lib.Redis.from_url(url) as r:
                    assert r.ping(), name
        with redis_lib.Redis.from_url(f"redis://{address}/0") as r, pytest.raises(redis_lib.AuthenticationError):
            r.ping()
        probe = c["readinessProbe"]["exec"]["command"]
        env = {**os.environ, "REDISCLI_AUTH": env_here(c)["REDISCLI_AUTH"]}
        out = subprocess.run([probe[0], "-p", str(srv.port), *probe[1:]], env=env, capture_output=True,
                             text=True, timeout=30)
        assert (out.returncode, out.stdout.strip()) == (0, "PONG"), out


def _dockerfile_uid() -> int:
    m = re.search(r"useradd\b[^\n]*--uid (\d+)", (ROOT / "Dockerfile").read_text())
    assert m, "the Dockerfile makes no user with a --uid"
    return int(m[1])


def test_pods_run_as_non_root_without_privileges():
    uid = _dockerfile_uid()
    for name, pod in pods().items():
        sc = pod["securityContext"]
        want = uid if all(c["image"].startswith("pagedq") for c in containers(pod)) else REDIS_UID
        assert sc["runAsNonRoot"] is True, name
        assert sc["runAsUser"] == sc["runAsGroup"] == sc["fsGroup"] == want, name
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in containers(pod):
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert csc["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
            assert not csc.get("privileged") and csc.get("runAsUser", want) == want, (name, c["name"])
            assert csc.get("runAsNonRoot", True) is True, (name, c["name"])


def _serve() -> tuple[dict, dict]:
    pod = pods()["pagedq-serve"]
    (c,) = pod["containers"]
    return pod, c


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_serve_runs_on_the_workers_redis_with_health_probes_and_keys_from_a_secret():
    from serve.routes import operations

    dep = named("Deployment", "pagedq-serve")
    pod, c = _serve()
    assert dep["spec"]["replicas"] == 2
    check_cli(c["command"])
    assert c["command"][:2] == ["pagedq", "serve"] and _option(c["command"], "--host") == "0.0.0.0"
    port = int(_option(c["command"], "--port"))
    (cport,) = c["ports"]
    assert cport["containerPort"] == port
    res = c["resources"]
    assert not any("gpu" in k for part in res.values() for k in part), "serve needs no GPU"
    assert {"cpu", "memory"} <= set(res["requests"])
    paths = {r.path for r in operations(lambda: None, None).routes}
    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health" and get["path"] in paths and get["port"] in (cport["name"], port), probe
    svc = named("Service", "pagedq-serve")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (sport,) = svc["spec"]["ports"]
    assert sport["port"] == 8000 and sport["targetPort"] in (cport["name"], port)
    (worker,) = pods()["pagedq-worker"]["containers"]
    env = env_here(c)
    assert env["REDIS_URL"] == env_here(worker)["REDIS_URL"] and env["PAGEDQ_QUEUE"] == config()["PAGEDQ_QUEUE"]
    key_file = Path(env["PAGEDQ_SERVE_API_KEY_FILE"])
    mounts = {Path(m["mountPath"]): m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[key_file.parent]]["secret"]["secretName"] == "pagedq-api-keys"


def _get(url: str, key: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_serve_container_runs_here(tmp_path):
    """serve's container as the manifest runs it (its command, its environment: the workers' Redis with the
    Secret's password, the key file where the Secret is mounted), on a free port: its probe answers, and
    requests need a key of the file."""
    from bench.harness import Process
    from worker.redis_server import RedisServer, free_port

    _, c = _serve()
    key = "sk-" + secrets.token_hex(8)
    (tmp_path / "keys").write_text(f"ops: {key}\n")
    with RedisServer(password=PASSWORD) as srv:
        env = env_here(c, f"127.0.0.1:{srv.port}")
        env["PAGEDQ_SERVE_API_KEY_FILE"] = str(tmp_path / Path(env["PAGEDQ_SERVE_API_KEY_FILE"]).name)
        port = free_port()
        cmd = [sys.executable, "-m", "cli", *c["command"][1:]]
        cmd[cmd.index("--port") + 1] = str(port)
        keep = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_") and k not in URL_VARS}
        p = Process(cmd, tmp_path / "serve.log", env=keep | env, cwd=ROOT, name="pagedq serve (serve.yaml)")
        try:
            p.wait_healthy(f"http://127.0.0.1:{port}{c['readinessProbe']['httpGet']['path']}", timeout=60)
            assert _get(f"http://127.0.0.1:{port}/v1/models") == 401
            assert _get(f"http://127.0.0.1:{port}/v1/models", key) == 200
        finally:
            p.stop()


def _secret_keys_read() -> set[tuple[str, str]]:
    """(Secret, key) of every Secret the manifests read: env references, KEDA's and files under secret volumes."""
    read = {(r["name"], r["key"]) for a in by_kind("TriggerAuthentication") for r in a["spec"]["secretTargetRef"]}
    for pod in pods().values():
        secret_dirs = {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        for c in containers(pod):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    read.add((ref["name"], ref["key"]))
            dirs = {Path(m["mountPath"]): secret_dirs[m["name"]] for m in c.get("volumeMounts", [])
                    if m["name"] in secret_dirs}
            for value in env_here(c).values():
                if Path(value).parent in dirs:
                    read.add((dirs[Path(value).parent], Path(value).name))
    return read


def test_the_docs_create_every_secret_the_manifests_read():
    section = (ROOT / "docs" / "operations.md").read_text().split("\n## Kubernetes\n", 1)[1].split("\n## ")[0]
    created = set()
    for line in section.splitlines():
        if line.startswith("kubectl create secret generic "):
            name, *flags = line.split()[4:]
            created |= {(name, f.split("=")[1]) for f in flags if f.startswith(("--from-literal=", "--from-file="))}
    read = _secret_keys_read()
    assert {(REDIS_SECRET["name"], REDIS_SECRET["key"]), ("pagedq-api-keys", "keys")} <= read
    assert read <= created, f"Secrets the manifests read that docs/operations.md does not create: {read - created}"
