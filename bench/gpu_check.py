"""`pagedq gpu-check`: the one command to run on a GPU. Prints a table, writes JSON.

1. kernels: the Triton ops in bf16 and fp16 against the torch path (float32 on the same values), at the test shapes;
2. bandwidth: decode attention, batch {1, 8, 64, 256} x context {512, 2048, 8192}, K/V bytes read per second as a
   fraction of a device-to-device copy's bytes moved per second (read + write) measured in the same run;
3. graphs: engine decode steps/s with CUDA graphs vs eager;
4. end to end: SmolLM2 bf16 on the bench's chat and mixed workloads, the engine vs transformers static batching and
   generate_batch on the same GPU.

No network and no Redis: `python -m bench.gpu_check` runs it where neither click nor redis is installed.
Exit status: 0 when it ran and every kernel was correct, 1 without a GPU, 2 when a kernel was wrong.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
from pathlib import Path

from engine.config import DEFAULT_MODEL

SECTIONS = ("kernels", "bandwidth", "graphs", "e2e")
TOL = {"bfloat16": 2e-2, "float16": 2e-3}
# (Hq, Hkv, head_dim, block_size, batch kind) as in tests/test_triton_kernels.py
KERNEL_CASES = [((9, 3), 64, 16), ((8, 2), 128, 16), ((4, 4), 64, 32), ((5, 1), 128, 32), ((32, 8), 128, 16)]
KINDS = {
    "decode": [(12, 1), (3, 1), (700, 1), (0, 1), (33, 1)],
    "prefill": [(0, 9), (0, 400), (0, 1), (0, 17)],
    "chunked": [(320, 200), (48, 5), (20, 31)],
    "mixed": [(0, 9), (6, 5), (12, 1), (3, 1), (0, 1), (900, 1), (160, 240)],
}
BATCHES = (1, 8, 64, 256)
CONTEXTS = (512, 2048, 8192)
# The command's options, once: `pagedq gpu-check` (bench.cli, click) and `python -m bench.gpu_check` (argparse,
# where click is not installed) are made from them. (flag, default, help)
OPTIONS = (("--out", "docs/bench/gpu-check.json", "Where the JSON goes"),
           ("--device", "cuda", "The GPU to check"),
           ("--sections", ",".join(SECTIONS), "Comma-separated subset"),
           ("--model", DEFAULT_MODEL, "Model of the end-to-end section"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagedq gpu-check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, help in OPTIONS:
        ap.add_argument(flag, default=default, help=f"{help} (default {default})")
    a = ap.parse_args(argv)
    return run(a.out, a.device, a.sections.split(","), a.model)


def run(out: str, device: str = "cuda", sections: list[str] | tuple[str, ...] = SECTIONS,
        model: str = DEFAULT_MODEL, echo=print) -> int:
    import torch

    if not torch.cuda.is_available():
        echo("gpu-check: no CUDA GPU here (torch.cuda.is_available() is False); nothing was measured")
        return 1
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        echo(f"gpu-check: unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
        return 2
    import triton

    data: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                  "triton": triton.__version__, "cuda": torch.version.cuda, "started": time.time()}
    steps = {"kernels": check_kernels, "bandwidth": attention_bandwidth, "graphs": graph_speedup,
             "e2e": lambda d: end_to_end(d, model)}
    for name in SECTIONS:
        if name not in sections:
            continue
        t0 = time.perf_counter()
        try:
            data[name] = steps[name](device)
        except Exception as e:  # noqa: BLE001 (one section failing must not hide the others' figures)
            data[name] = {"error": f"{type(e).__name__}: {e}"}
        data[name]["seconds"] = round(time.perf_counter() - t0, 1)
        gc.collect()
        torch.cuda.empty_cache()
    data["targets"] = targets(data)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    echo(table(data))
    echo(f"wrote {path}")
    return 2 if data.get("kernels", {}).get("ok") is False else 0


# ---- 1. kernel correctness -------------------------------------------------------------------------------------


def check_kernels(device: str, dtypes: tuple[str, ...] = ("bfloat16", "float16")) -> dict:
    import torch

    from kernels import triton_ops
    from kernels.testing import attend, oracle, random_batch, rel_err, store

    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for (hq, hkv), d, bs in KERNEL_CASES:
            for kind, shapes in KINDS.items():
                b = random_batch(hq, hkv, d, bs, shapes, dtype, device=device)
                store(triton_ops, b)
                rows.append(_kernel_row(dtype_name, f"{hq}/{hkv}x{d} bs{bs} {kind}", b, oracle, attend, rel_err))
        # split-K forced, and a cache of 40,000 blocks whose used ids are all above 32,768
        b = random_batch(8, 2, 128, 16, [(3000, 1), (5, 1), (1290, 1)], dtype, device=device)
        store(triton_ops, b)
        rows.append(_kernel_row(dtype_name, "8/2x128 split-K 7 segments", b, oracle,
                                lambda ops, x: attend(ops, x, segments=7), rel_err))
        b = random_batch(4, 1, 64, 16, [(7000, 1), (10000, 1), (64, 1)], dtype, num_blocks=40_000,
                         first_block=32_768, device=device)
        store(triton_ops, b)
        rows.append(_kernel_row(dtype_name, "4/1x64 40k-block cache, ids > 32768", b, oracle, attend, rel_err))
    return {"ok": all(r["ok"] for r in rows), "cases": rows, "tolerance": TOL}


def _kernel_row(dtype: str, name: str, b: dict, oracle, attend, rel_err) -> dict:
    from kernels import triton_ops

    out = attend(triton_ops, b)
    ref = oracle(b)
    err = rel_err(out, ref)
    abs_err = (out.float() - ref).abs().max().item() if err != float("inf") else float("inf")
    return {"dtype": dtype, "case": name, "max_abs_err": abs_err, "rel_err": err, "ok": err < TOL[dtype]}


# ---- 2. decode attention bandwidth -----------------------------------------------------------------------------


def _time(fn, min_s: float = 0.05) -> float:
    """Seconds per call of fn on the GPU (CUDA events, after a warmup)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    n, elapsed = 1, 0.0
    while True:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end) / 1000
        if elapsed >= min_s or n >= 4096:
            return elapsed / n
        n *= 4


def _copy_bandwidth(device: str, size: int = 1 << 30) -> float:
    """Bytes moved per second (read + written) by a device-to-device copy of `size` bytes."""
    import torch

    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * size / _time(functools.partial(dst.copy_, src))


def attention_bandwidth(device: str, hq: int = 9, hkv: int = 3, d: int = 64, bs: int = 16) -> dict:
    """SmolLM2's attention shape in bf16 over a paged cache with shuffled blocks."""
    import torch

    from kernels import triton_ops

    copy_bw = _copy_bandwidth(device)
    blocks_needed = max(BATCHES) * max(CONTEXTS) // bs
    k_cache = torch.randn(blocks_needed, bs, hkv, d, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(blocks_needed, device=device).to(torch.int32)
    rows = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            per_seq = ctx // bs
            table = perm[: batch * per_seq].view(batch, per_seq)
            q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
            qsl = torch.arange(batch + 1, device=device, dtype=torch.int32)
            lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
            t = _time(functools.partial(triton_ops.paged_attention, q, k_cache, v_cache, qsl, lens, table, d**-0.5))
            kv_bytes = 2 * batch * ctx * hkv * d * k_cache.element_size()
            rows.append({"batch": batch, "context": ctx, "us": t * 1e6, "gb_per_s": kv_bytes / t / 1e9,
                         "fraction_of_copy": kv_bytes / t / copy_bw,
                         "segments": triton_ops.num_segments(batch, hkv, ctx, q.device)})
    return {"shape": {"hq": hq, "hkv": hkv, "head_dim": d, "block_size": bs, "dtype": "bfloat16"},
            "copy_gb_per_s": copy_bw / 1e9, "cases": rows}


# ---- 3. CUDA graphs vs eager -----------------------------------------------------------------------------------


def graph_speedup(device: str, model: str = DEFAULT_MODEL, batches: tuple[int, ...] = (1, 8, 64),
                  steps: int = 64) -> dict:
    from engine import EngineConfig, LLMEngine, SamplingParams

    rows = []
    for eager in (False, True):
        engine = LLMEngine(EngineConfig(model=model, device=device, max_num_seqs=max(batches), num_kv_blocks=4096,
                                        enforce_eager=eager))
        for batch in batches:
            params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
            for i in range(batch):
                engine.add_request(f"g{eager}-{batch}-{i}", prompt_token_ids=[1 + (i + j) % 500 for j in range(32)],
                                   params=params)
            engine.step()  # all prompts in one prefill step; every later step is decode only
            engine.step()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            _sync(device)
            rows.append({"batch": batch, "graphs": not eager, "steps_per_s": steps / (time.perf_counter() - t0)})
            while engine.has_unfinished_requests():
                engine.step()
        del engine
        gc.collect()
    speedup = {}
    for batch in batches:
        g = next(r["steps_per_s"] for r in rows if r["batch"] == batch and r["graphs"])
        e = next(r["steps_per_s"] for r in rows if r["batch"] == batch and not r["graphs"])
        speedup[str(batch)] = g / e
    return {"cases": rows, "speedup": speedup}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# ---- 4. end to end -----------------------------------------------------------------------------------------------


def end_to_end(device: str, model: str = DEFAULT_MODEL, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
               quick: bool = False) -> dict:
    from transformers import AutoTokenizer

    from bench import workloads as wls
    from bench.systems import load_hf, run_engine, run_hf_cb, run_hf_static
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.loader import resolve_model

    folder = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sets = [wls.build(name, tokenizer, quick) for name in ("chat", "mixed")]
    longest = max(len(r.prompt_ids) + r.max_tokens for s in sets for r in s.requests)
    blocks = max_num_seqs * -(-longest // 16) + max_num_seqs
    engine = LLMEngine(EngineConfig(model=model, device=device, max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=blocks))
    engine.generate(["Warm up.", "Warm up, again."], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    runs = [run_engine(engine, wl, progress=False) for wl in sets]
    chat = engine.generate([engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])],
                           SamplingParams(max_tokens=24, temperature=0))[0].text
    del engine
    gc.collect()
    hf = load_hf(folder, device, "bfloat16" if device.startswith("cuda") else "float32")
    for wl in sets:
        runs.append(run_hf_static(hf, wl, max_num_seqs, progress=False))
        runs.append(run_hf_cb(hf, wl, max_num_seqs, max_num_batched_tokens, progress=False))
    out = {"runs": [r.summary() for r in runs], "chat_reply": chat}
    tput = {(r.system, r.workload): r.throughput() for r in runs}
    out["ratios"] = {f"{w}: engine / {peer}": tput[("pagedq", w)] / tput[(peer, w)]
                     for w in ("chat", "mixed") for peer in ("hf-static", "hf-cb") if tput.get((peer, w))}
    return out


# ---- report ------------------------------------------------------------------------------------------------------


def targets(data: dict) -> list[dict]:
    """The issue's targets, each with what was measured (None where its section did not run)."""
    k = data.get("kernels", {})
    bw = [r["fraction_of_copy"] for r in data.get("bandwidth", {}).get("cases", [])
          if r["batch"] >= 64 and r["context"] >= 2048]
    g = data.get("graphs", {}).get("speedup", {}).get("8")
    e2e = data.get("e2e", {}).get("ratios", {}).get("mixed: engine / hf-static")
    return [
        {"target": "all kernels correct in bf16 and fp16", "measured": k.get("ok"), "met": k.get("ok")},
        {"target": "decode attention >= 70% of copy bandwidth (batch >= 64, context >= 2048), worst case",
         "measured": min(bw) if bw else None, "met": min(bw) >= 0.7 if bw else None},
        {"target": "CUDA graphs >= 1.5x eager decode steps/s at batch 8", "measured": g,
         "met": g >= 1.5 if g else None},
        {"target": "engine >= 3x transformers static batching on mixed", "measured": e2e,
         "met": e2e >= 3 if e2e else None},
    ]


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def table(data: dict) -> str:
    lines = [f"gpu-check on {data['device']} (torch {data['torch']}, triton {data['triton']})", ""]
    k = data.get("kernels")
    if k:
        if "error" in k:
            lines.append(f"kernels: {k['error']}")
        else:
            for dt in TOL:
                cases = [c for c in k["cases"] if c["dtype"] == dt]
                if not cases:
                    continue
                worst = max(cases, key=lambda c: c["rel_err"])
                bad = sum(not c["ok"] for c in cases)
                lines.append(f"kernels {dt}: {len(cases)} cases, worst rel err {_fmt(worst['rel_err'])} "
                             f"({worst['case']}), max abs err {_fmt(max(c['max_abs_err'] for c in cases))}, "
                             f"{bad} over tolerance {TOL[dt]}")
    bw = data.get("bandwidth")
    if bw:
        if "error" in bw:
            lines.append(f"bandwidth: {bw['error']}")
        else:
            lines += ["", f"decode attention, fraction of copy bandwidth ({bw['copy_gb_per_s']:.0f} GB/s moved)",
                      "batch | " + " | ".join(f"ctx {c}" for c in CONTEXTS)]
            for b in BATCHES:
                cells = [next(r for r in bw["cases"] if r["batch"] == b and r["context"] == c) for c in CONTEXTS]
                lines.append(f"{b:5d} | " + " | ".join(f"{r['fraction_of_copy']:.0%} ({r['gb_per_s']:.0f} GB/s)"
                                                       for r in cells))
    g = data.get("graphs")
    if g:
        lines.append("")
        if "error" in g:
            lines.append(f"graphs: {g['error']}")
        else:
            for b, s in g["speedup"].items():
                rate = next(r["steps_per_s"] for r in g["cases"] if str(r["batch"]) == b and r["graphs"])
                lines.append(f"decode steps/s at batch {b}: {rate:.0f} with graphs, {s:.2f}x eager")
    e = data.get("e2e")
    if e:
        lines.append("")
        if "error" in e:
            lines.append(f"e2e: {e['error']}")
        else:
            for r in e["runs"]:
                lines.append(f"{r['workload']:6s} {r['system']:10s} {_fmt(r.get('output_tokens_per_s'))} tok/s")
            for name, ratio in e["ratios"].items():
                lines.append(f"{name}: {ratio:.2f}x")
            lines.append(f"chat reply: {e['chat_reply']!r}")
    lines += ["", "target | measured | met"]
    lines += [f"{t['target']} | {_fmt(t['measured'])} | {_fmt(t['met'])}" for t in data["targets"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
