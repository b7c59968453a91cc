"""What durability "replicated" costs against "async", on a primary with one replica, both on loopback:

- submit latency: sequential `Client.submit` calls (one job each), p50 and p99;
- worker throughput: one worker (a tiny random-weight model on the CPU, so that Redis round trips weigh as much as
  they ever do: the worst case for WAIT) runs a batch of jobs; tokens/s from the first submit to the last result.

    python -m bench.durability [--submits 1000] [--jobs 256] [--max-tokens 128] [--rounds 2] [--json out.json]

A replica on loopback confirms within a fraction of a millisecond; across a network or availability zone, add its
round trip to every write.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import repo_env, start_logged
from producer import Client, JobRequest
from producer.durability import Durability, online_replicas
from worker.redis_server import RedisServer

REPO = Path(__file__).resolve().parent.parent


def _percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def submit_latency(url: str, durability: str, n: int, tag: str) -> dict:
    c = Client(url, queue=f"lat-{durability}-{tag}", durability=Durability(durability))
    try:
        for i in range(20):  # warm up: the scripts loaded, the connection open
            c.submit(JobRequest(id=f"warm-{i}", prompt="hi", max_tokens=1))
        ms = []
        for i in range(n):
            t = time.perf_counter()
            c.submit(JobRequest(id=f"j-{i}", prompt="Job says hello", max_tokens=16))
            ms.append((time.perf_counter() - t) * 1000)
    finally:
        c.close()
    return {"p50_ms": round(statistics.median(ms), 3), "p99_ms": round(_percentile(ms, 99), 3), "n": n}


def worker_throughput(url: str, durability: str, model: str, jobs: int, max_tokens: int, tag: str) -> dict:
    queue = f"tp-{durability}-{tag}"
    w = start_logged([sys.executable, "-m", "cli", "worker", "--redis-url", url, "--queue", queue, "--model",
                      model, "--device", "cpu", "--max-num-seqs", "32", "--durability", durability],
                     f"/tmp/pagedq-bench-durability-{durability}.log", env=repo_env(HF_HUB_OFFLINE="1"))
    c = Client(url, queue=queue)
    try:
        c.submit(JobRequest(id="warm", prompt="warm up", max_tokens=8)).result(timeout=300)
        reqs = [JobRequest(id=f"t-{i}", prompt=f"Job {i} says", max_tokens=max_tokens, ignore_eos=True,
                           temperature=0) for i in range(jobs)]
        t = time.perf_counter()
        c.submit_many(reqs)
        results = [c.result(r.id, timeout=600) for r in reqs]
        seconds = time.perf_counter() - t
    finally:
        c.close()
        w.stop(30)
    tokens = sum(r.usage.completion_tokens for r in results)
    assert all(r.status == "completed" for r in results)
    return {"jobs": jobs, "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1)}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--submits", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each level, interleaved")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    model = subprocess.run([sys.executable, str(REPO / "tests" / "tiny_model.py")], capture_output=True, text=True,
                           check=True).stdout.strip().splitlines()[-1]
    out: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "model": "tiny random-weight llama (tests/tiny_model.py)",
                 "replica": "one, on loopback", "levels": {}}
    with RedisServer() as primary, RedisServer(args=["--replicaof", "127.0.0.1", str(primary.port)]) as replica:
        probe = Client(primary.url)
        deadline = time.monotonic() + 20
        while online_replicas(probe.redis) < 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica on port {replica.port} did not attach")
            time.sleep(0.1)
        probe.close()
        # Interleaved rounds (async, replicated, async, ...), so that a neighbour's load hits both levels alike.
        for i in range(a.rounds):
            for level in ("async", "replicated"):
                run = {"submit": submit_latency(primary.url, level, a.submits, f"r{i}"),
                       "worker": worker_throughput(primary.url, level, model, a.jobs, a.max_tokens, f"r{i}")}
                out["levels"].setdefault(level, []).append(run)
                print(level, json.dumps(run), flush=True)
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
