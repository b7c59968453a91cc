"""A real Prometheus server (Debian's `prometheus`, installed by .ci/run) scrapes a real worker: after a few
jobs its query API returns the series the issue lists, with the values the jobs produced, and every metric the
Grafana dashboard queries exists."""

import json
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from bench.harness import Process
from producer import Client
from worker.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
GRAFANA_DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "pagedq.json"
JOBS, MAX_TOKENS = 5, 7

EXPECTED = [
    "pagedq_queue_wait_seconds_bucket", "pagedq_time_to_first_token_seconds_bucket",
    "pagedq_time_per_output_token_seconds_bucket", "pagedq_e2e_seconds_bucket", "pagedq_batch_size_sequences_bucket",
    "pagedq_batch_size_tokens_bucket", "pagedq_step_seconds_bucket", "pagedq_prompt_tokens_total",
    "pagedq_generated_tokens_total", "pagedq_prefix_cache_hit_tokens_total", "pagedq_preemptions_total",
    "pagedq_jobs_total", "pagedq_job_retries_total", "pagedq_dead_letters_total", "pagedq_lease_losses_total",
    "pagedq_running_sequences", "pagedq_waiting_sequences", "pagedq_kv_blocks_used", "pagedq_kv_blocks_total",
    "pagedq_queue_depth", "pagedq_queue_pending_entries", "pagedq_queue_oldest_pending_age_seconds",
]


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if not path:
        pytest.skip("the `prometheus` server is not installed (Debian: apt-get install prometheus; .ci/run does)")
    return path


@pytest.fixture
def prometheus(tmp_path):
    """start(targets) -> the base URL of a Prometheus scraping `targets` every second."""
    binary = prometheus_binary()
    procs = []

    def start(targets: list[str]) -> str:
        port = free_port()
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "pagedq", "static_configs": [{"targets": targets}]}],
        }))
        p = Process([binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
                     f"--web.listen-address=127.0.0.1:{port}"], tmp_path / "prometheus.log", name="prometheus")
        procs.append(p)
        base = f"http://127.0.0.1:{port}"
        p.wait_healthy(f"{base}/-/ready", timeout=60)
        return base

    yield start
    for p in procs:
        p.stop(10)


def wait_for(cond, timeout: float, what: str, proc=None):
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            tail = ""
            if proc is not None:
                proc.log.seek(0)
                tail = proc.log.read()[-3000:]
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.2)


def query(base: str, expr: str) -> list[dict]:
    reply = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=5).json()
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def value(base: str, expr: str) -> float | None:
    res = query(base, expr)
    return float(res[0]["value"][1]) if res else None


def dashboard_metrics() -> set[str]:
    """The pagedq_* metric names the Grafana dashboard's panels query."""
    names = set()
    for panel in json.loads(GRAFANA_DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            names |= set(re.findall(r"\bpagedq_[a-z0-9_]+", target["expr"]))
    return names


def test_prometheus_scrapes_the_worker(redis_url, queue, pq_tiny_model, start_worker, prometheus):
    port = free_port()
    start_worker(queue, pq_tiny_model, "--max-num-seqs", "4", "--num-kv-blocks", "64", "--max-model-len", "256",
                 "--metrics-port", str(port), "--heartbeat-s", "0.5")
    base = prometheus([f"127.0.0.1:{port}"])
    with Client(redis_url, queue=queue) as c:
        jobs = c.submit_many([{"prompt": f"count {i}", "max_tokens": MAX_TOKENS, "temperature": 0,
                               "ignore_eos": True} for i in range(JOBS)])
        results = [j.result(timeout=180) for j in jobs]
    assert all(r.status == "completed" for r in results)
    produced = sum(r.usage.completion_tokens for r in results)
    prompt = sum(r.usage.prompt_tokens for r in results)
    sel = f'{{queue="{queue}"}}'

    # Scraped every second: wait for a scrape that saw the last job.
    wait_for(lambda: value(base, f"pagedq_generated_tokens_total{sel}") == produced, 60,
             f"generated tokens == {produced}")
    assert value(base, f'pagedq_jobs_total{{queue="{queue}",status="completed"}}') == JOBS
    assert value(base, f"pagedq_prompt_tokens_total{sel}") == prompt
    for hist in ("queue_wait", "time_to_first_token", "e2e"):
        assert value(base, f"pagedq_{hist}_seconds_count{sel}") == JOBS, hist
    assert value(base, f"pagedq_time_per_output_token_seconds_count{sel}") == JOBS
    steps = value(base, f"pagedq_engine_steps_total{sel}")
    assert value(base, f"pagedq_batch_size_sequences_count{sel}") == steps
    assert value(base, f"pagedq_batch_size_tokens_sum{sel}") >= prompt + produced - JOBS  # prefill + decode
    assert value(base, f"pagedq_kv_blocks_total{sel}") == 64
    wait_for(lambda: value(base, f"pagedq_queue_depth{sel}") == 0, 30, "the queue depth gauge to read 0")
    # A quantile over the histogram's buckets (over all time: a rate needs two scrapes that saw it change).
    p50 = value(base, f"histogram_quantile(0.5, sum by (le) (pagedq_time_to_first_token_seconds_bucket{sel}))")
    assert p50 is not None and p50 > 0

    names = set(httpx.get(f"{base}/api/v1/label/__name__/values", timeout=5).json()["data"])
    assert not set(EXPECTED) - names
    if GRAFANA_DASHBOARD.exists():
        missing = {n for n in dashboard_metrics() if n not in names}
        assert not missing, f"the Grafana dashboard queries metrics no worker exports: {missing}"
