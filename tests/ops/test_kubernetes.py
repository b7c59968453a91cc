"""deploy/kubernetes/: valid against the Kubernetes schemas, offline (kubernetes-validate ships them), and wired
to what the worker really does: its command, its metrics port, its queue's stream and consumer group."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from producer.keys import GROUP, Keys

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
K8S_VERSION = "1.30.0"


def docs() -> list[dict]:
    yaml = pytest.importorskip("yaml")
    return [d for f in MANIFESTS for d in yaml.safe_load_all(f.read_text()) if d]


def by_kind(kind: str) -> list[dict]:
    return [d for d in docs() if d["kind"] == kind]


def test_manifests_match_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (the dev extra has it)")
    checked = 0
    for d in docs():
        if d["apiVersion"].startswith("keda.sh/"):  # a CRD: no schema in the Kubernetes set (checked below)
            continue
        kv.validate(d, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 5 and {"Deployment", "StatefulSet", "Service", "ConfigMap"} <= {d["kind"] for d in docs()}


def test_worker_deployment_runs_real_commands_with_probes_and_a_drain():
    (dep,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "pagedq-worker"]
    spec = dep["spec"]["template"]["spec"]
    (worker,) = spec["containers"]
    env = {k: v for cm in by_kind("ConfigMap") for k, v in cm["data"].items()}
    for c in [*spec["initContainers"], worker]:
        args = [a for a in c["command"][1:] if not a.startswith("$")] + ["--help"]
        assert c["command"][0] == "pagedq" and CliRunner().invoke(main, args).exit_code == 0, c["command"]
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


def test_keda_scales_the_worker_on_its_queue():
    (so,) = by_kind("ScaledObject")
    cm = by_kind("ConfigMap")[0]["data"]
    assert so["spec"]["scaleTargetRef"]["name"] == "pagedq-worker"
    assert so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    triggers = so["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"redis-streams"}
    assert {t["metadata"]["stream"] for t in triggers} == set(Keys(cm["PAGEDQ_QUEUE"]).lane_streams())
    for t in triggers:
        assert t["metadata"]["address"] in cm["REDIS_URL"]
    pending = [t for t in triggers if "pendingEntriesCount" in t["metadata"]]
    assert pending and all(t["metadata"]["consumerGroup"] == GROUP for t in pending)
