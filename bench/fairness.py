"""The fairness workload (issue 39): does an urgent job still get its first token fast behind a big batch, and do
fair-share groups get the workers by their weights?

One worker (SmolLM2-135M-Instruct by default, the worker's default quantization, MAX_NUM_SEQS sequences a step)
runs three phases:

- alone: URGENT interactive-lane chat jobs (URGENT_TOKENS tokens, greedy), each submitted alone on the idle worker
  once the one before has ended;
- behind a batch: BATCH_JOBS batch-lane jobs (~50-token prompts, BATCH_TOKENS tokens, ignore_eos) are queued
  first; once BUSY_AFTER of them have completed (the batch fills the worker), as many urgent jobs come one at a
  time, SPACING_S apart ("spaced", the headline figure), then all at once ("burst"). Reported: TTFT p50 / p90 /
  max of each, the ratios p50(spaced) / p50(alone) and max(spaced) / max(alone) against the issue's target
  (<= 1.5x), how many batch jobs started between each urgent job's enqueue and its start (the lane floor lets
  one in per --lane-floor jobs of the lanes above), and the worker's preemptions meanwhile
  (pagedq_preemptions_total: the KV cache is sized so that none is for room, so each is for priority);
- group shares: three groups of weights 1:2:4, GROUP_JOBS equal jobs each (GROUP_TOKENS tokens, ignore_eos),
  all queued before a fresh worker reads any. Reported: each group's share of the tokens of the first half of
  the jobs to complete (by finished_at; every group still has jobs queued then) against its weight's (1/7, 2/7,
  4/7), and the largest error relative to the target (target: <= 10%).

TTFT is first_token_at - enqueued_at of the job's result: both clocks are this machine's (the producer's and the
worker's). Each phase's urgent prompts are distinct, so that no phase gets another's prompt from the prefix cache.
The batch is not waited for: its worker is stopped once the urgent jobs are measured. Everything shares the
machine's cores: the worker, Redis and this process.

`python3 -m bench.fairness [--quick]` or `pagedq bench -w fairness`.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.harness import Process, start_logged
from bench.report import write_json
from bench.serve_load import pct
from engine.config import DEFAULT_MODEL

URGENT = 10
URGENT_TOKENS = 16
BATCH_JOBS = 2000
BATCH_TOKENS = 64
BATCH_WORDS = 44  # + "Batch job N:": ~50 prompt tokens (most of these words are one token each)
BUSY_AFTER = 3  # batch jobs completed before the urgent ones come: the batch is under way, the worker full
SPACING_S = 1.5  # between spaced urgent jobs: longer than one takes alone, so that they do not queue behind each other
IDLE_GAP_S = 0.5  # before each lone urgent job: the worker is back in its blocking wait for jobs
GROUP_JOBS = 150
GROUP_TOKENS = 16
WEIGHTS = {"g1": 1, "g2": 2, "g4": 4}
# 16 sequences: a full batch on 2 cores whose decode step stays short; at the CPU default (256) a step of 256
# sequences alone is longer than an urgent job's TTFT when the worker is idle.
MAX_NUM_SEQS = 16
MAX_MODEL_LEN = 512
TARGET_TTFT_RATIO = 1.5
TARGET_SHARE_ERROR = 0.10
QUICK = {"urgent": 3, "batch_jobs": 60, "group_jobs": 20, "spacing_s": 0.5}
QUEUE = "fairness"
GROUPS_QUEUE = "fairness-groups"  # a queue of its own: its jobs are all queued before its worker starts
WORDS = ("the", "queue", "worker", "batch", "token", "model", "river", "stone", "light", "house", "green", "small",
         "quick", "paper", "music", "water", "north", "field", "cloud", "table", "story", "night", "bright", "winter",
         "garden", "window", "market", "letter", "simple", "number", "people", "answer", "little", "moment", "reason",
         "summer", "animal", "yellow", "forest", "mountain", "silver", "planet", "engine", "orange")
TOPICS = ("rivers", "bread", "the moon", "bicycles", "volcanoes", "owls", "glass", "tea", "maps", "bees", "salt",
          "clocks", "snow", "copper", "whales", "paper", "tides", "lamps", "cotton", "kites")


# ---- the jobs ---------------------------------------------------------------------------------------------------

def urgent_job(phase: str, i: int):
    """A short chat question; `phase` ("alone", "spaced", "burst") leads its text: no two phases share a prompt
    block past the chat template's own, whatever i is."""
    from producer import JobRequest

    topic = TOPICS[i % len(TOPICS)]
    return JobRequest(id=f"urgent-{phase}-{i}", lane="interactive", max_tokens=URGENT_TOKENS, temperature=0,
                      messages=[{"role": "user", "content": f"{phase} question {i}: tell me one fact about {topic}."}])


def batch_job(i: int):
    from producer import JobRequest

    rng = random.Random(i)
    text = f"Batch job {i}: " + " ".join(rng.choice(WORDS) for _ in range(BATCH_WORDS))
    return JobRequest(id=f"batch-{i}", lane="batch", prompt=text, max_tokens=BATCH_TOKENS, temperature=0,
                      ignore_eos=True)


def group_job(group: str, i: int):
    from producer import JobRequest

    return JobRequest(id=f"{group}-{i}", group=group, prompt=f"Job {i} of group {group}: count from one to twenty.",
                      max_tokens=GROUP_TOKENS, temperature=0, ignore_eos=True)


# ---- the worker -------------------------------------------------------------------------------------------------

def _start_worker(url: str, queue: str, model: str, device: str, max_num_seqs: int, metrics_port: int,
                  log: Path) -> Process:
    # KV blocks for every sequence at full length, twice over: nothing is preempted for room, so every preemption
    # counted is one for priority. --drain-timeout 1: the batch is not waited for when the worker is stopped.
    blocks = 2 * max_num_seqs * (MAX_MODEL_LEN // 16)
    return start_logged([sys.executable, "-m", "cli", "worker", "--redis-url", url, "--queue", queue,
                         "--model", model, "--device", device, "--max-num-seqs", str(max_num_seqs),
                         "--num-kv-blocks", str(blocks), "--max-model-len", str(MAX_MODEL_LEN),
                         "--metrics-port", str(metrics_port), "--drain-timeout", "1", "--log-level", "WARNING"],
                        log)


def _results(client, ids: list[str], proc: Process, log: Path, timeout: float = 900) -> list:
    """The jobs' results, failing with the worker's log if it exits while they are awaited."""
    end = time.monotonic() + timeout
    out = []
    for job_id in ids:
        while True:
            try:
                out.append(client.result(job_id, timeout=1))
                break
            except TimeoutError:
                if proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"job {job_id}: no result; worker log: {log.read_text()[-1500:]}") from None
    return out


def _preemptions(metrics_port: int) -> int | None:
    """The worker's pagedq_preemptions_total now (None: not read)."""
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pagedq_preemptions_total")))


# ---- the phases -------------------------------------------------------------------------------------------------

def _ttft(r) -> float:
    return r.timings.first_token_at - r.timings.enqueued_at


def _ttft_stats(results: list) -> dict:
    ttft = [_ttft(r) for r in results]
    return {"n": len(ttft), "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
            "ttft_max_s": max(ttft, default=None)}


def phase_alone(client, n: int, proc: Process, log: Path) -> dict:
    """Each urgent job alone on the idle worker, one after another."""
    results = []
    for i in range(n):
        time.sleep(IDLE_GAP_S)
        job = client.submit(urgent_job("alone", i))
        results += _results(client, [job.id], proc, log)
    return {**_ttft_stats(results), "jobs": [{"id": r.id, "ttft_s": _ttft(r)} for r in results]}


def _behind(client, results: list, batch_ids: list[str]) -> dict:
    """TTFT figures of urgent jobs run behind the batch, and what the batch did meanwhile (from the job hashes'
    started_at: the worker's clock, as the results' timings)."""
    pipe = client.redis.pipeline(transaction=False)
    for job_id in batch_ids:
        pipe.hget(client.keys.job(job_id), "started_at")
    started = sorted(float(s) for s in pipe.execute() if s)
    jobs = []
    for r in results:
        t = r.timings
        jobs.append({"id": r.id, "ttft_s": _ttft(r), "queue_wait_s": t.started_at - t.enqueued_at,
                     # batch jobs started while it waited: the lane floor's share, or intake ignoring the lanes
                     "batch_started_between": sum(t.enqueued_at < s < t.started_at for s in started),
                     # batch jobs not started yet when it came: above 0, the batch was still queued (the worker full)
                     "batch_queued_at_enqueue": len(batch_ids) - sum(s <= t.enqueued_at for s in started)})
    return {**_ttft_stats(results), "batch_started_between_max": max(j["batch_started_between"] for j in jobs),
            "batch_queued_at_enqueue_min": min(j["batch_queued_at_enqueue"] for j in jobs), "jobs": jobs}


def phase_behind(client, n: int, batch_jobs: int, spacing_s: float, proc: Process, log: Path,
                 metrics_port: int, echo: Callable[[str], None]) -> dict:
    """The batch queued; once it runs, n urgent jobs spaced, then n at once."""
    batch_ids = [j.id for j in client.submit_many([batch_job(i) for i in range(batch_jobs)])]
    first = _results(client, batch_ids[:BUSY_AFTER], proc, log)
    echo(f"fairness: {BUSY_AFTER} batch jobs done (the batch under way); {n} urgent jobs {spacing_s:g} s apart")
    p0 = _preemptions(metrics_port)
    start = time.monotonic()
    ids = []
    for i in range(n):
        time.sleep(max(0.0, start + i * spacing_s - time.monotonic()))
        ids.append(client.submit(urgent_job("spaced", i)).id)
    spaced = _behind(client, _results(client, ids, proc, log), batch_ids)
    p1 = _preemptions(metrics_port)
    echo(f"fairness: {n} urgent jobs at once")
    burst_ids = [j.id for j in client.submit_many([urgent_job("burst", i) for i in range(n)])]
    burst = _behind(client, _results(client, burst_ids, proc, log), batch_ids)
    p2 = _preemptions(metrics_port)
    spaced["preemptions"] = None if p0 is None or p1 is None else p1 - p0
    burst["preemptions"] = None if p1 is None or p2 is None else p2 - p1
    return {"batch_jobs": batch_jobs, "batch_prompt_tokens_mean": sum(r.usage.prompt_tokens for r in first) / len(first),
            "spacing_s": spacing_s, "spaced": spaced, "burst": burst}


def phase_groups(url: str, per_group: int, model: str, device: str, max_num_seqs: int, out: Path,
                 echo: Callable[[str], None]) -> dict:
    """Three groups of weights 1:2:4 queued whole, then a fresh worker: each group's share of the tokens of the
    first half of the jobs to complete."""
    from producer import Client
    from producer.groups import GroupSettings, set_group
    from worker.redis_server import free_port

    with Client(url, queue=GROUPS_QUEUE) as c:
        for name, weight in WEIGHTS.items():
            set_group(c.redis, c.keys, name, GroupSettings(weight=weight))
        reqs = [group_job(g, i) for i in range(per_group) for g in WEIGHTS]
        ids = [j.id for j in c.submit_many(reqs)]
        echo(f"fairness: {len(ids)} group jobs queued (weights {WEIGHTS}); a fresh worker reads them")
        port, log = free_port(), out / "fairness-groups-worker.log"
        proc = _start_worker(url, GROUPS_QUEUE, model, device, max_num_seqs, port, log)
        try:
            proc.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=600)
            results = _results(c, ids, proc, log)
        finally:
            proc.stop(15)
    # The first half: with 1/7 of the jobs per weight unit, even the heaviest group has jobs queued throughout it.
    first = sorted(results, key=lambda r: r.timings.finished_at)[: len(results) // 2]
    tokens = {g: sum(r.usage.completion_tokens for r in first if r.id.startswith(f"{g}-")) for g in WEIGHTS}
    total = sum(tokens.values()) or 1
    groups = {}
    for g, w in WEIGHTS.items():
        target = w / sum(WEIGHTS.values())
        share = tokens[g] / total
        groups[g] = {"weight": w, "jobs": per_group, "tokens_first_half": tokens[g], "target_share": target,
                     "share": share, "relative_error": abs(share - target) / target}
    return {"jobs_per_group": per_group, "jobs_measured": len(first), "groups": groups,
            "max_relative_error": max(x["relative_error"] for x in groups.values())}


# ---- the run ----------------------------------------------------------------------------------------------------

def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or b is None else b / a


def run_fairness(device: str = "cpu", quick: bool = False, batch_jobs: int | None = None, model: str = DEFAULT_MODEL,
                 max_num_seqs: int | None = None, out_dir: str = "bench/results", echo: Callable[[str], None] = print,
                 urgent: int | None = None, group_jobs: int | None = None) -> dict:
    """Run the workload; write fairness.json to `out_dir` and return its figures. quick: the same model and
    worker, with QUICK's counts (a smoke run: its figures are not a measurement)."""
    from bench import report
    from engine.config import EngineConfig
    from producer import Client
    from worker.config import WorkerConfig
    from worker.redis_server import RedisServer, free_port

    n = urgent or (QUICK["urgent"] if quick else URGENT)
    batch = batch_jobs or (QUICK["batch_jobs"] if quick else BATCH_JOBS)
    per_group = group_jobs or (QUICK["group_jobs"] if quick else GROUP_JOBS)
    spacing = QUICK["spacing_s"] if quick else SPACING_S
    seqs = max_num_seqs or MAX_NUM_SEQS
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with RedisServer() as srv:
        port, log = free_port(), out / "fairness-worker.log"
        proc = _start_worker(srv.url, QUEUE, model, device, seqs, port, log)
        try:
            proc.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=600)
            with Client(srv.url, queue=QUEUE) as c:
                # The model loaded and stepped on both lanes before anything is measured.
                _results(c, [c.submit(urgent_job("warm", 0)).id, c.submit(batch_job(-1)).id], proc, log)
                echo(f"fairness: {n} urgent jobs alone, on {model} ({device}, {seqs} sequences a step)")
                alone = phase_alone(c, n, proc, log)
                echo(f"fairness: {batch} batch jobs queued")
                behind = phase_behind(c, n, batch, spacing, proc, log, port, echo)
        finally:
            proc.stop(15)  # the batch with it: what it has not run is not waited for
        groups = phase_groups(srv.url, per_group, model, device, seqs, out, echo)
    ratios = {k: {"p50": _ratio(alone["ttft_p50_s"], behind[k]["ttft_p50_s"]),
                  "max": _ratio(alone["ttft_max_s"], behind[k]["ttft_max_s"])} for k in ("spaced", "burst")}
    spaced = ratios["spaced"]
    data = {"machine": report.machine(device), "workload": "fairness", "model": Path(model).name,
            "quantization": f"{EngineConfig.quantization} (the worker's default)", "max_num_seqs": seqs,
            "lane_floor": WorkerConfig.lane_floor,
            # Without it (the engine half of issue 39 not merged), an urgent job waits for a batch job to end.
            "engine_preempts_for_priority": "preempt_for_priority" in {f.name for f in dataclasses.fields(EngineConfig)},
            "urgent_jobs": n, "urgent_tokens": URGENT_TOKENS, "batch_tokens": BATCH_TOKENS,
            "group_tokens": GROUP_TOKENS, "alone": alone, "behind": behind, "ttft_ratio": ratios, "groups": groups,
            "targets": {"ttft_ratio": TARGET_TTFT_RATIO, "share_relative_error": TARGET_SHARE_ERROR},
            "met": {"ttft_ratio": all(r is not None and r <= TARGET_TTFT_RATIO for r in spaced.values()),
                    "group_shares": groups["max_relative_error"] <= TARGET_SHARE_ERROR}}
    path = write_json(data, out, "fairness.json")
    echo(table(data))
    echo(f"wrote {path}")
    return data


def table(data: dict) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f} ms"

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    b, r = data["behind"], data["ttft_ratio"]
    lines = [f"fairness on {data['machine']['cpu']} ({data['machine']['cpu_cores']} cores): {data['model']}, "
             f"{data['max_num_seqs']} sequences a step, engine preempts for priority: "
             f"{'yes' if data['engine_preempts_for_priority'] else 'no'}",
             f"{'urgent TTFT':<34}{'n':>4}{'p50':>10}{'p90':>10}{'max':>10}{'p50 / alone':>13}{'max / alone':>13}"]
    for label, x, rr in (("alone", data["alone"], None), (f"behind {b['batch_jobs']} batch jobs, spaced", b["spaced"],
                                                           r["spaced"]),
                         (f"behind {b['batch_jobs']} batch jobs, burst", b["burst"], r["burst"])):
        lines.append(f"{label:<34}{x['n']:>4}{ms(x['ttft_p50_s']):>10}{ms(x['ttft_p90_s']):>10}"
                     f"{ms(x['ttft_max_s']):>10}{ratio(rr and rr['p50']):>13}{ratio(rr and rr['max']):>13}")
    for k in ("spaced", "burst"):
        lines.append(f"  {k}: batch jobs started while an urgent one waited, at most {b[k]['batch_started_between_max']}"
                     f"; preemptions {b[k]['preemptions']}; batch jobs still queued at an urgent one's arrival, "
                     f"at least {b[k]['batch_queued_at_enqueue_min']}")
    met = data["met"]
    lines.append(f"spaced TTFT ratio target <= {data['targets']['ttft_ratio']}x (p50 and max): "
                 f"{'met' if met['ttft_ratio'] else 'NOT met'}")
    g = data["groups"]
    lines.append(f"{'group':<8}{'weight':>8}{'target':>10}{'share':>10}{'rel. error':>12}   "
                 f"(tokens of the first {g['jobs_measured']} jobs to complete)")
    for name, x in g["groups"].items():
        lines.append(f"{name:<8}{x['weight']:>8}{x['target_share']:>10.1%}{x['share']:>10.1%}"
                     f"{x['relative_error']:>12.1%}")
    lines.append(f"max relative share error {g['max_relative_error']:.1%}, target <= "
                 f"{data['targets']['share_relative_error']:.0%}: {'met' if met['group_shares'] else 'NOT met'}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batch-jobs", type=int, default=None, help=f"batch jobs queued (default {BATCH_JOBS})")
    ap.add_argument("--max-num-seqs", type=int, default=None, help=f"the worker's (default {MAX_NUM_SEQS})")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out-dir", default="bench/results")
    a = ap.parse_args()
    run_fairness(a.device, a.quick, a.batch_jobs, a.model, a.max_num_seqs, a.out_dir)


if __name__ == "__main__":
    main()
