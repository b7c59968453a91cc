"""The overhead workload: what the host spends per decode step, by phase, at 64, 256 and 1,024 running sequences.

A one-layer model with a tiny hidden size and the real tokenizer makes the forward nearly free, so what is left
is the work that would keep a GPU waiting: scheduling, building inputs, bookkeeping, detokenizing, publishing.
Measured on the engine direct, and through a worker on a real Redis (the worker's loop, with its publisher
process writing to Redis beside it). Host time = step time - forward - sampling. The engine runs overlapped steps,
as on a GPU: there each step's host work runs while the device computes the step before, so the device waits
only where a step's host time exceeds its forward.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

from engine.stats import PHASES

SIZES = (64, 256, 1024)
QUICK_SIZES = (16, 64)
STEPS = 40  # decode steps measured per size
WARMUP = 5
PROMPT = "Write a long story about a queue of jobs that never ends, one token at a time:"
MAX_MODEL_LEN = 512
HOST_PHASES = [p for p in PHASES if p not in ("forward", "sample")]


def micro_model() -> str:
    """The one-layer random model, built once into the model cache."""
    from bench.random_model import make_tiny_model
    from engine.weights.loader import cache_root

    return make_tiny_model(str(cache_root() / "micro-llama-1layer-v1"), "llama", seed=0, layers=1)


def make_engine(model: str, n: int, device: str):
    from engine import EngineConfig, LLMEngine

    blocks = n * math.ceil(MAX_MODEL_LEN / 16) + 16
    return LLMEngine(EngineConfig(model=model, device=device, dtype="float32", max_num_seqs=n,
                                  max_num_batched_tokens=max(2048, n), num_kv_blocks=blocks,
                                  max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, overlap_steps=True))


def _params():
    from engine import SamplingParams

    # Long enough that nobody finishes while measured; greedy: the sampler is not what is measured.
    return SamplingParams(max_tokens=MAX_MODEL_LEN - 64, temperature=0, ignore_eos=True)


def _all_decoding(engine, n: int) -> bool:
    return engine.request_counts()[0] == n and engine.num_decoding() == n


def measure_direct(engine, n: int, steps: int = STEPS) -> dict:
    for i in range(n):
        engine.add_request(f"o{i}", prompt=f"{PROMPT} {i}", params=_params())
    while not _all_decoding(engine, n):
        engine.step()
    for _ in range(WARMUP):
        engine.step()
    engine.times.reset()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t) / steps
    for i in range(n):
        engine.abort(f"o{i}")
    return _figures(engine, n, wall)


def measure_worker(engine, n: int, steps: int = STEPS) -> dict:
    """The same steady state through a Worker on a real redis-server: jobs submitted with the client, the
    worker's loop in a thread of this process (so its engine's phase times can be read)."""
    from producer import Client
    from worker.config import WorkerConfig
    from worker.redis_server import RedisServer
    from worker.worker import Worker

    with RedisServer() as srv:
        w = Worker(engine, WorkerConfig(redis_url=srv.url, queue="overhead", drain_timeout=0))
        loop = threading.Thread(target=w.run, name="overhead-worker", daemon=True)
        loop.start()
        try:
            with Client(srv.url, queue="overhead") as c:
                p = _params()
                c.submit_many([{"id": f"o{i}", "prompt": f"{PROMPT} {i}", "max_tokens": p.max_tokens,
                                "temperature": 0, "ignore_eos": True} for i in range(n)])
            _wait(lambda: _all_decoding(engine, n), "every job decoding")
            _wait_steps(w, WARMUP)
            engine.times.reset()
            first, t = w.steps, time.perf_counter()
            _wait_steps(w, steps)
            wall = (time.perf_counter() - t) / (w.steps - first)
            figures = _figures(engine, n, wall)
        finally:
            w.stop()
            loop.join(60)
    return figures


def _wait(cond: Callable[[], bool], what: str, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"overhead bench: timed out waiting for {what}")
        time.sleep(0.005)


def _wait_steps(w, k: int) -> None:
    target = w.steps + k
    _wait(lambda: w.steps >= target, f"{k} worker steps")


def _figures(engine, n: int, wall_s: float) -> dict:
    ms = engine.times.per_step_ms()
    # Time in the loop outside any phase (intake, the GIL held by other threads, ...) is host time too.
    other = max(0.0, 1000 * wall_s - sum(ms.values()))
    host = sum(ms[p] for p in HOST_PHASES) + other
    return {"sequences": n, "step_ms": 1000 * wall_s, "phases_ms": ms, "other_ms": other, "host_ms": host,
            "host_us_per_seq": 1000 * host / n}


def run_overhead(device: str = "cpu", quick: bool = False, paths: tuple[str, ...] = ("direct", "redis"),
                 out_dir: str | Path = "bench/results", charts: bool = True,
                 echo: Callable[[str], None] = print, sizes: tuple[int, ...] | None = None,
                 steps: int | None = None) -> dict:
    """Measure every size on each path; write overhead.json (and overhead.png) to `out_dir`."""
    from bench import report

    model = micro_model()
    sizes = sizes or (QUICK_SIZES if quick else SIZES)
    steps = steps or (10 if quick else STEPS)
    data: dict = {"machine": report.machine(device), "workload": "overhead", "model": model, "steps": steps,
                  "results": []}
    echo(f"pagedq bench -w overhead: one-layer model, decode steps at {', '.join(map(str, sizes))} sequences")
    for n in sizes:
        engine = make_engine(model, n, device)
        for path in paths:
            fig = (measure_direct if path == "direct" else measure_worker)(engine, n, steps)
            fig["path"] = path
            data["results"].append(fig)
            echo(line(fig))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(data, indent=2))
    echo(f"wrote {out / 'overhead.json'}")
    if charts:
        echo(f"wrote {chart(data, out / 'overhead.png')}")
    return data


def line(fig: dict) -> str:
    ph = ", ".join(f"{p} {fig['phases_ms'][p]:.2f}" for p in PHASES)
    return (f"  {fig['path']:>6} {fig['sequences']:>5} seqs: step {fig['step_ms']:.2f} ms, host {fig['host_ms']:.2f} ms "
            f"({fig['host_us_per_seq']:.1f} us/seq) [{ph}, other {fig['other_ms']:.2f}]")


def chart(data: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = sorted({r["path"] for r in data["results"]})
    fig, axes = plt.subplots(1, len(paths), figsize=(5 * len(paths), 4), squeeze=False)
    for ax, p in zip(axes[0], paths):
        rows = [r for r in data["results"] if r["path"] == p]
        labels = [str(r["sequences"]) for r in rows]
        bottom = [0.0] * len(rows)
        for phase in HOST_PHASES:
            vals = [r["phases_ms"][phase] for r in rows]
            ax.bar(labels, vals, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.bar(labels, [r["other_ms"] for r in rows], bottom=bottom, label="other")
        ax.set_title(f"host ms per decode step ({p})")
        ax.set_xlabel("running sequences")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
