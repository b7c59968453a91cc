"""run_bench: every chosen system on every chosen workload, in one run, on one model; then ratios vs targets."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import torch

from bench import mfu, report
from bench import workloads as wls
from bench.result import Run
from bench.systems import (
    ALL,
    DEFAULT,
    ENGINE,
    HF_CB,
    HF_SINGLE,
    HF_STATIC,
    LABELS,
    LLAMACPP,
    REDIS,
    SERVE,
    VLLM,
)
from engine.config import DEFAULT_MODEL

# Online arrivals run at this fraction of the capacity measured on a closed batch of the same shape:
# near capacity, where queueing shows in TTFT, yet below it, so the queue does not grow without bound.
RATE_FRACTION = 0.9
BLOCK_SIZE = 16

# name, workload, system, baseline (None: MFU), target
TARGETS = [
    ("chat: pagedq / HF one-at-a-time", "chat", ENGINE, HF_SINGLE, 10.0),
    ("mixed: pagedq / HF static batching", "mixed", ENGINE, HF_STATIC, 2.0),
    ("mixed: pagedq / HF generate_batch", "mixed", ENGINE, HF_CB, 3.0),
    ("chat: via Redis / engine direct", "chat", REDIS, ENGINE, 0.95),
    ("mixed: via Redis / engine direct", "mixed", REDIS, ENGINE, 0.95),
    ("shared-prefix: via Redis / engine direct", "shared-prefix", REDIS, ENGINE, 0.95),
    ("mixed: pagedq MFU", "mixed", ENGINE, None, 0.60),
    ("chat: pagedq / vLLM", "chat", ENGINE, VLLM, 1.0),
    ("mixed: pagedq / vLLM", "mixed", ENGINE, VLLM, 1.0),
    ("chat: pagedq / llama.cpp", "chat", ENGINE, LLAMACPP, 4.0),
    ("mixed: pagedq / llama.cpp", "mixed", ENGINE, LLAMACPP, 4.0),
]
# Lower is better: name, workload, system, baseline, summary field, the most system / baseline may be.
LATENCY_TARGETS = [
    ("online: TTFT p50 via serve / via Redis", "online", SERVE, REDIS, "ttft_p50_s", 1.15),
    ("online: TPOT p50 via serve / via Redis", "online", SERVE, REDIS, "tpot_p50_s", 1.15),
]
# One request alone: its TPOT over the time copying the weights once takes at the measured copy bandwidth (bytes
# copied per second). The time reading them once (a sum's bandwidth, about twice that) goes in bench.json beside it.
SINGLE_STREAM_TARGET = ("single: TPOT / weight-copy time", "single", ENGINE, 1.3)


def run_bench(
    model: str = DEFAULT_MODEL,
    device: str | None = None,
    workloads: Iterable[str] = wls.NAMES,
    systems: Iterable[str] = DEFAULT,
    quick: bool = False,
    out_dir: str | Path = "bench/results",
    *,
    dtype: str | None = None,
    num_requests: dict[str, int] | None = None,
    hf_single_requests: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    progress: bool = True,
    charts: bool = True,
    echo: Callable[[str], None] = print,
    vllm_python: str | None = None,
    llamacpp_server: str | None = None,
    quantization: str = "auto",
) -> dict:
    """Run the benchmark and write bench.json (and PNG charts) to `out_dir`. Returns what bench.json holds.

    `num_requests` scales workloads ({"mixed": 32}); `hf_single_requests` caps the one-at-a-time baseline
    (default 4, 2 with `quick`); `rate` fixes the online arrival rate instead of measuring capacity;
    `vllm_python`: the Python of an environment with vLLM installed (see bench.vllm_peer); `llamacpp_server`: a
    llama-server binary (bench.llamacpp_peer); `quantization`: the engine's (EngineConfig.quantization)."""
    workloads = list(dict.fromkeys(workloads))
    systems = list(dict.fromkeys(systems))
    for w in workloads:
        if w not in wls.NAMES:
            raise ValueError(f"unknown workload {w!r}; choose from {', '.join(wls.NAMES)}")
    for s in systems:
        if s not in ALL:
            raise ValueError(f"unknown system {s!r}; choose from {', '.join(ALL)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    from engine.config import EngineConfig

    # None and "auto" resolved the engine's way, so every system runs what the engine would.
    resolved = EngineConfig(device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens)
    dtype, max_num_seqs, max_num_batched_tokens = (resolved.dtype, resolved.max_num_seqs,
                                                   resolved.max_num_batched_tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_single_requests = hf_single_requests or (2 if quick else 4)
    logging.getLogger("transformers").setLevel(logging.ERROR)  # their per-call warnings would bury the bars
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)

    from transformers import AutoTokenizer

    from engine.weights.loader import resolve_model

    folder = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sets = {w: wls.build(w, tokenizer, quick, (num_requests or {}).get(w), seed) for w in workloads}
    # The capacity probe for `online` gets other prompts of the same shape, so that no prefix cache is warm
    # with the very prompts it then times.
    probe = wls.build("online", tokenizer, quick, (num_requests or {}).get("online"), seed + 1) \
        if "online" in sets and rate is None else None
    kv_blocks = _kv_blocks([*sets.values(), *([probe] if probe else [])], max_num_seqs)
    config = {"model": model, "folder": str(folder), "device": device, "dtype": dtype, "quick": quick,
              "quantization": quantization,
              "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
              "num_kv_blocks": kv_blocks, "block_size": BLOCK_SIZE, "seed": seed, "workloads": workloads,
              "systems": systems, "hf_single_requests": hf_single_requests,
              "workload_specs": {w: {**s.spec, "n": len(s.requests)} for w, s in sets.items()}}
    data: dict = {"machine": report.machine(device), "config": config, "results": [], "ratios": []}
    echo(f"pagedq bench: {model} ({dtype}) on {device}; workloads {', '.join(workloads)}; "
         f"systems {', '.join(systems)}")
    for w, s in sets.items():
        p = [len(r.prompt_ids) for r in s.requests]
        o = [r.max_tokens for r in s.requests]
        echo(f"  {w}: {len(p)} requests, prompt {min(p)}-{max(p)} tokens (mean {sum(p) / len(p):.0f}), "
             f"output {min(o)}-{max(o)} (mean {sum(o) / len(o):.0f})")

    peak = mfu.matmul_peak(device, getattr(torch, dtype))
    params = _param_counts(folder)
    data["matmul_peak"] = peak
    data["params"] = params
    echo(f"  matmul peak: {peak['flops_per_s'] / 1e9:.1f} GFLOP/s ({peak['size']}^3, {peak['dtype']}); "
         f"model: {params['total'] / 1e6:.1f} M parameters")
    if "single" in sets:
        bandwidth = data["memory_bandwidth"] = mfu.memory_bandwidth(device)
        data["weight_bytes"] = mfu.weight_bytes(params, getattr(torch, dtype))
        echo(f"  memory: {bandwidth['read_bytes_per_s'] / 1e9:.1f} GB/s read, "
             f"{bandwidth['copy_bytes_per_s'] / 1e9:.1f} GB/s copied; "
             f"{data['weight_bytes'] / 1e6:.0f} MB of weights read a decode step")

    engine = hf = redis = serve = None
    redis_error = None
    runs: list[Run] = []
    # vLLM first, in a process of its own that has ended before pagedq loads: the two never share the cores.
    vllm = _run_vllm(vllm_python, str(folder), dtype, max_num_seqs, max_num_batched_tokens, sets, tokenizer, quick,
                     seed, out, data, echo) if VLLM in systems else None
    llamacpp = _run_llamacpp(llamacpp_server, model, max_num_seqs, sets, tokenizer, quick, seed, out, data,
                             echo) if LLAMACPP in systems else None
    try:
        if ENGINE in systems:
            t = time.perf_counter()
            engine = _load_engine(model, device, dtype, max_num_seqs, max_num_batched_tokens, kv_blocks,
                                  quantization)
            data.setdefault("startup_s", {})[ENGINE] = time.perf_counter() - t
        if any(s in systems for s in (HF_SINGLE, HF_STATIC, HF_CB)):
            hf = _load_hf(folder, device, dtype)
        if REDIS in systems or SERVE in systems:  # the serve path runs on the Redis path's queue and worker
            from bench.redis_path import RedisPath, Unavailable

            echo("  starting redis-server and a worker...")
            try:
                redis = RedisPath(model, device, dtype, max_num_seqs, max_num_batched_tokens, kv_blocks,
                                  out / "worker.log").start()
            except Unavailable as e:
                redis_error = str(e)
                echo(f"  pagedq via Redis unavailable: {redis_error}")
            if SERVE in systems and redis is not None:
                from bench.serve_path import ServePath

                try:
                    serve = ServePath(redis, model, out / "serve.log").start()
                except Unavailable as e:
                    echo(f"  via pagedq serve unavailable: {e}")

        for w, wl in sets.items():
            # Untimed, on other prompts of the same shape: first-call costs (allocation, kernel choice,
            # a manager's start) stay out of the figures, and no prefix cache is warm with timed prompts.
            warm = _warm_set(w, tokenizer, quick, seed)
            for s in systems:
                path_up = (s != REDIS or redis is not None) and (s != SERVE or serve is not None)
                if path_up and s not in (VLLM, LLAMACPP):  # the peers warm up in their own processes
                    _one(s, warm, engine, hf, redis, redis_error, 1, max_num_seqs, max_num_batched_tokens, False,
                         serve)
            if wl.online:
                wl = sets[w] = _online(wl, probe, rate, engine, redis, data, progress, echo)
            for s in systems:
                run = _one(s, wl, engine, hf, redis, redis_error, hf_single_requests, max_num_seqs,
                           max_num_batched_tokens, progress, serve, vllm, llamacpp)
                runs.append(run)
                summary = run.summary()
                if run.ok:
                    flops = mfu.run_flops(params, run)
                    summary["model_flops_per_s"] = flops / run.elapsed
                    summary["mfu"] = flops / run.elapsed / peak["flops_per_s"]
                data["results"].append(summary)
                echo(_line(summary))
    finally:
        if serve is not None:
            serve.close()
        if redis is not None:
            redis.close()

    data["ratios"] = ratios(data["results"], workloads, data)
    echo("")
    echo(report.table(data["results"], data["ratios"]))
    path = report.write_json(data, out)
    echo(f"\nwrote {path}")
    if charts:
        for p in report.charts(data, out):
            echo(f"wrote {p}")
    return data


def _run_vllm(python, folder, dtype, max_num_seqs, max_num_batched_tokens, sets, tokenizer, quick, seed, out, data,
              echo) -> tuple[dict[str, Run], str]:
    """vLLM over every offline workload -> (Run per workload, why it did not run or "")."""
    from bench import vllm_peer

    offline = {w: wl for w, wl in sets.items() if not wl.online}
    if not offline:
        return {}, ""
    spec = vllm_peer.job(folder, dtype, max_num_seqs, max_num_batched_tokens,
                         [(_warm_set(w, tokenizer, quick, seed), wl) for w, wl in offline.items()])
    try:
        runs, info = vllm_peer.run_all(python, torch.get_num_threads(), spec, offline, out / "vllm.log", echo)
    except vllm_peer.Unavailable as e:
        echo(f"  vLLM unavailable: {e}")
        return {}, str(e)
    data["vllm"] = info
    data.setdefault("startup_s", {})[VLLM] = info["startup_s"]
    echo(f"  vLLM {info['version']}: started in {info['startup_s']:.0f} s")
    return runs, ""


def _run_llamacpp(server_bin, model, max_num_seqs, sets, tokenizer, quick, seed, out, data, echo
                  ) -> tuple[dict[str, Run], str]:
    """llama.cpp's server over every offline workload, on the model's GGUF -> (Run per workload, why not or "")."""
    from bench import llamacpp_peer
    from engine.weights.loader import gguf_source

    offline = {w: wl for w, wl in sets.items() if not wl.online}
    try:
        binary = llamacpp_peer.find_server(server_bin)
        gguf = gguf_source(model)
        if gguf is None:
            raise llamacpp_peer.Unavailable(f"{model} is not a GGUF file: llama.cpp runs GGUF only")
        longest = max(len(r.prompt_ids) + r.max_tokens for wl in offline.values() for r in wl.requests)
        parallel = min(max_num_seqs, max(len(wl.requests) for wl in offline.values()))
        echo(f"  starting llama-server ({parallel} slots of {longest} tokens, {torch.get_num_threads()} threads)")
        server = llamacpp_peer.Server(binary, str(gguf), torch.get_num_threads(), parallel, longest,
                                      out / "llamacpp.log")
    except llamacpp_peer.Unavailable as e:
        echo(f"  llama.cpp unavailable: {e}")
        return {}, str(e)
    runs = {}
    try:
        for w, wl in offline.items():
            warm = _warm_set(w, tokenizer, quick, seed)  # a few requests: the server's first-call costs
            llamacpp_peer.run_workload(server, replace(warm, requests=warm.requests[:4]), parallel)
            runs[w] = llamacpp_peer.run_workload(server, wl, parallel)
    finally:
        server.close()
    data.setdefault("startup_s", {})[LLAMACPP] = server.startup_s
    echo(f"  llama.cpp: started in {server.startup_s:.1f} s")
    return runs, ""


def _kv_blocks(sets: list[wls.Workload], max_num_seqs: int) -> int:
    # Room for every running sequence at the longest request's full length: the same cache for the engine,
    # the worker and (in tokens) transformers' continuous batching, and no preemption to blur the figures.
    need = 0
    for s in sets:
        longest = max(len(r.prompt_ids) + r.max_tokens for r in s.requests)
        need = max(need, min(len(s.requests), max_num_seqs) * math.ceil(longest / BLOCK_SIZE))
    return need + max_num_seqs


def _warm_set(name: str, tokenizer, quick: bool, seed: int) -> wls.Workload:
    wl = wls.build(name, tokenizer, quick, 4, seed + 2)
    wl.requests = [replace(r, id=f"warm-{r.id}", max_tokens=min(4, r.max_tokens)) for r in wl.requests]
    return wl


def _param_counts(folder) -> dict:
    # Built on the meta device: counts without memory, and without depending on which systems run.
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return mfu.param_counts(meta)


def _load_engine(model, device, dtype, max_num_seqs, max_num_batched_tokens, kv_blocks, quantization="auto"):
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=kv_blocks,
                                    block_size=BLOCK_SIZE, quantization=quantization))
    engine.generate(["Warm up.", "Warm up, again."], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    return engine


def _load_hf(folder, device, dtype):
    from bench.systems import _gen_kwargs, load_hf

    model = load_hf(folder, device, dtype)
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 4]], device=model.device)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **_gen_kwargs(model, 4))
    return model


def _online(wl, probe, rate, engine, redis, data, progress, echo):
    info: dict = {"fraction": RATE_FRACTION}
    if rate is None:
        # Capacity: the same shape of requests, all at once, on the engine (or through Redis without one).
        probe_run = None
        if engine is not None:
            probe_run = _guard(ENGINE, probe, lambda: _engine_run(engine, probe, progress))
        elif redis is not None:
            probe_run = _guard(REDIS, probe, lambda: redis.run(probe, progress))
        if probe_run is None or not probe_run.ok:
            info["error"] = "no system to measure capacity with" if probe_run is None else probe_run.note
            data["online"] = info
            echo(f"  online: capacity unknown ({info['error']}); arrivals all at once")
            return wl
        capacity = len(probe_run.outcomes) / probe_run.elapsed
        rate = RATE_FRACTION * capacity
        info.update(capacity_req_per_s=capacity, capacity_system=probe_run.system,
                    capacity_output_tokens_per_s=probe_run.throughput())
    info["rate_per_s"] = rate
    data["online"] = info
    echo(f"  online: Poisson arrivals at {rate:.2f} req/s"
         + (f" ({RATE_FRACTION:.0%} of measured capacity {info['capacity_req_per_s']:.2f} req/s)"
            if "capacity_req_per_s" in info else ""))
    return wl.with_poisson(rate)


def _engine_run(engine, wl, progress):
    from bench.systems import run_engine

    return run_engine(engine, wl, progress)


def _one(s, wl, engine, hf, redis, redis_error, hf_single_requests, max_num_seqs, max_num_batched_tokens,
         progress, serve=None, vllm=None, llamacpp=None) -> Run:
    from bench.systems import run_hf_cb, run_hf_single, run_hf_static

    if s in (VLLM, LLAMACPP):
        runs, why = (vllm if s == VLLM else llamacpp) or ({}, "not started")
        return runs.get(wl.name) or Run(s, wl.name, status="skipped" if wl.online else "unavailable",
                                        note="offline system: no arrivals" if wl.online else why)
    if s == REDIS and redis is None:
        return Run(s, wl.name, status="unavailable", note=redis_error or "not started")
    if s == SERVE and serve is None:
        return Run(s, wl.name, status="unavailable", note=redis_error or "did not start (see serve.log)")
    if wl.online and s not in (ENGINE, REDIS, SERVE):
        return Run(s, wl.name, status="skipped", note="offline system: no arrivals")
    if s == ENGINE:
        return _guard(s, wl, lambda: _engine_run(engine, wl, progress))
    if s == REDIS:
        return _guard(s, wl, lambda: redis.run(wl, progress))
    if s == SERVE:
        return _guard(s, wl, lambda: serve.run(wl, progress))
    if s == HF_SINGLE:
        return _guard(s, wl, lambda: run_hf_single(hf, wl, hf_single_requests, progress))
    if s == HF_STATIC:
        return _guard(s, wl, lambda: run_hf_static(hf, wl, max_num_seqs, progress))
    return _guard(s, wl, lambda: run_hf_cb(hf, wl, max_num_seqs, max_num_batched_tokens, progress))


def _guard(system: str, wl, fn) -> Run:
    # One system failing leaves the others' figures standing; the table says what went wrong.
    try:
        return fn()
    except Exception as e:
        logging.getLogger("pagedq.bench").debug("%s on %s failed", system, wl.name, exc_info=True)
        return Run(system, wl.name, status="error", note=f"{type(e).__name__}: {e}"[:300])


def _line(r: dict) -> str:
    head = f"  {r['workload']}: {LABELS[r['system']]}"
    if r["status"] != "ok":
        return f"{head}: {r['status']}: {r['note']}"
    chk = "ok" if r["checked"] else f"{r['num_mismatched']} MISMATCHED"
    return f"{head}: {r['output_tokens_per_s']:.1f} out tok/s in {r['elapsed_s']:.1f} s, check {chk}"


def ratios(results: list[dict], workloads: list[str], data: dict | None = None) -> list[dict]:
    """Each target that the chosen workloads cover, measured from this run's results; pass / fail / n/a. data: the
    run's bench.json so far (memory bandwidth and weight bytes, for the single-stream bound)."""
    found = {(r["workload"], r["system"]): r for r in results}
    out = []
    for name, w, sys_, base, target in TARGETS:
        if w not in workloads:
            continue
        q = {"name": name, "workload": w, "system": sys_, "baseline": base, "target": target,
             "kind": "mfu" if base is None else "ratio", "value": None, "why": "", "result": "n/a"}
        a = found.get((w, sys_))
        b = found.get((w, base)) if base else None
        missing = [x for x, r in ((sys_, a), (base, b)) if x and (r is None or r["status"] != "ok")]
        bad = [x for x, r in ((sys_, a), (base, b)) if r is not None and r["status"] == "ok" and not r["checked"]]
        if missing:
            q["why"] = f"{', '.join(missing)} did not run"
        elif base is None:
            q["value"] = a["mfu"]
        else:
            q["value"] = a["output_tokens_per_s"] / b["output_tokens_per_s"]
        if q["value"] is not None:
            q["result"] = "pass" if q["value"] >= target else "fail"
            if bad:  # a figure from wrong outputs proves nothing
                q["result"] = "fail"
                q["why"] = f"output check failed: {', '.join(bad)}"
        out.append(q)
    for name, w, sys_, base, field, most in LATENCY_TARGETS:
        if w not in workloads:
            continue
        q = {"name": name, "workload": w, "system": sys_, "baseline": base, "target": most, "kind": "latency",
             "value": None, "why": "", "result": "n/a"}
        a, b = found.get((w, sys_)), found.get((w, base))
        missing = [x for x, r in ((sys_, a), (base, b)) if r is None or r["status"] != "ok" or not r.get(field)]
        if missing:
            q["why"] = f"{', '.join(missing)} did not run"
        else:
            q["value"] = a[field] / b[field]
            q["result"] = "pass" if q["value"] <= most and a["checked"] and b["checked"] else "fail"
        out.append(q)
    if SINGLE_STREAM_TARGET[1] in workloads:
        out.append(_single_stream(found, data or {}))
    return out


def _single_stream(found: dict, data: dict) -> dict:
    name, w, sys_, most = SINGLE_STREAM_TARGET
    q = {"name": name, "workload": w, "system": sys_, "baseline": None, "target": most, "kind": "latency",
         "value": None, "why": "", "result": "n/a"}
    run = found.get((w, sys_))
    bandwidth = data.get("memory_bandwidth", {})
    if run is None or run["status"] != "ok" or not run.get("tpot_p50_s") or not bandwidth:
        q["why"] = f"{sys_} did not run" if run is None or run["status"] != "ok" else "no TPOT or bandwidth"
        return q
    bound = data["weight_bytes"] / bandwidth["copy_bytes_per_s"]
    q["value"] = run["tpot_p50_s"] / bound
    q["bound_s"] = bound
    q["over_read_time"] = run["tpot_p50_s"] * bandwidth["read_bytes_per_s"] / data["weight_bytes"]
    q["result"] = "pass" if q["value"] <= most and run["checked"] else "fail"
    return q
