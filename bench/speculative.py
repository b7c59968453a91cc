"""`pagedq bench -w spec` (also `python -m bench.speculative`): speculative decoding against none, in one run, for
every mode the engine offers (engine.config.SPECULATIVE), on the engine direct (issue 42).

Workloads, greedy:
- grounded: one stream at a time, three tasks on a ~1,000-token report (summarize, rewrite with small changes,
  extract facts as a list), up to 200 new tokens each;
- json: one stream, the report's facts extracted under a JSON schema (the engine's structured output);
- chat: one stream, an open-ended prompt with nothing to copy;
- concurrent: the chat workload of `pagedq bench` (64 requests, 50-token prompts, 100 new tokens) all at once.
Reported per workload and mode: decode tokens/s (single stream: after the prefill step) or output tokens/s
(concurrent: over the run), the ratio to off, the acceptance rate, the mean accepted length (tokens a sequence landed
per step it carried drafts), and whether the tokens equal off's. llama.cpp's server (bench.llamacpp_peer), when
given, runs the grounded tasks on the same GGUF and threads, greedy, as many tokens as off made.

Every mode's engine is loaded first; then the runs take turns (each case, every mode), `reps` rounds, each kept
at its best, so that a stray load on the machine hits all modes alike. Prefix caching is off and a suffix index is
set back to what it held when the case first ran: every round does the same work.

    python -m bench.speculative [--model smollm2-135m-instruct] [--quantization auto none] [--mode ngram] [--k 4]
                                [--reps 2] [--quick] [--llamacpp-server PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import spec_texts

WORKLOADS = ("grounded", "json", "chat", "concurrent")
MAX_TOKENS = 200
QUICK_TOKENS = 12
REPS = 2
BLOCK_SIZE = 16
# Issue 42's targets: each mode's tokens/s over off's, per workload, and the grounded workload over llama.cpp's.
TARGETS = {"grounded": 2.0, "json": 1.5, "chat": 0.95, "concurrent": 0.97}
LLAMACPP_TARGET = 3.0


@dataclass
class Case:
    workload: str
    name: str
    prompts: list[list[int]]
    params: list  # SamplingParams, one per prompt


def _cases(model: str, quick: bool, seed: int) -> list[Case]:
    """The runs of every workload, as token ids the model's chat template made."""
    from transformers import AutoTokenizer

    from bench.workloads import build
    from engine import Constraint, SamplingParams
    from engine.tokens import chat_prompt
    from engine.weights.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))

    tokens = QUICK_TOKENS if quick else MAX_TOKENS
    greedy = SamplingParams(max_tokens=tokens, temperature=0)
    ask = lambda text: chat_prompt(tokenizer, model, [{"role": "user", "content": text}])  # noqa: E731
    doc = spec_texts.DOC + "\n\n"
    cases = [Case("grounded", name, [ask(doc + task)], [greedy]) for name, task in spec_texts.TASKS.items()]
    schema = Constraint("json_schema", spec_texts.JSON_SCHEMA)
    cases.append(Case("json", "extract", [ask(doc + spec_texts.JSON_TASK)],
                      [SamplingParams(max_tokens=tokens, temperature=0, constraint=schema)]))
    cases.append(Case("chat", "story", [ask(spec_texts.CHAT)], [greedy]))
    chat = build("chat", tokenizer, quick, None, seed)
    cases.append(Case("concurrent", f"{len(chat.requests)} chats", [list(r.prompt_ids) for r in chat.requests],
                      [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
                       for r in chat.requests]))
    return cases


def _kv_blocks(cases: list[Case], k: int, max_num_seqs: int) -> int:
    # Every sequence of the largest case at its full length, drafts included: no preemption blurs the figures.
    need = 0
    for c in cases:
        longest = max(len(p) + s.max_tokens for p, s in zip(c.prompts, c.params)) + k + 1
        need = max(need, min(len(c.prompts), max_num_seqs) * math.ceil(longest / BLOCK_SIZE))
    return need + max_num_seqs


def _engine(model: str, device: str, dtype: str | None, quantization: str, mode: str, k: int, seqs: int,
            blocks: int | None):
    from engine import EngineConfig, LLMEngine

    # The draft pair: the model's own GGUF blocks (Q4_1 for the shipped one) drafting for it, the pair
    # where the target runs dequantized (--quantization none).
    draft = dict(draft_model=model, draft_quantization="auto") if mode == "draft" else {}
    return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, quantization=quantization,
                                  speculative=mode, num_speculative_tokens=k, max_num_seqs=seqs,
                                  num_kv_blocks=blocks, block_size=BLOCK_SIZE, enable_prefix_caching=False, **draft))


class _Drafted:
    """Counts the sequences that carried drafts into a step (one Speculator.settle call each), which
    eng.speculation.steps (steps with any draft) does not tell apart in a batch."""

    def __init__(self, eng) -> None:
        self.n = 0
        spec = getattr(eng.loop, "speculator", None)
        if spec is not None and hasattr(spec, "settle"):
            settle = spec.settle

            def counted(*args, **kwargs):
                self.n += 1
                return settle(*args, **kwargs)

            spec.settle = counted
        else:
            self.n = None  # speculation off, or a Speculator without settle: steps stand in (_spec_delta)


def _counts(eng, drafted: _Drafted) -> tuple[int, int, int, int | None]:
    s = eng.speculation
    return s.steps, s.proposed, s.accepted, drafted.n


def _stream(eng, drafted: _Drafted, case: Case, rid: str) -> dict:
    """One request alone, stepped by hand: its decode time starts where its first token (the prefill's) lands."""
    before = _counts(eng, drafted)
    eng.add_request(rid, prompt_token_ids=case.prompts[0], params=case.params[0])
    first = out = None
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
            first = first or time.perf_counter()
        steps += 1
    end = time.perf_counter()
    n = len(out.token_ids)
    fig = dict(tokens=n, seconds=end - first, tps=(n - 1) / max(end - first, 1e-9), steps=steps,
               ids=[list(out.token_ids)], text=out.text)
    return fig | _spec_delta(before, _counts(eng, drafted))


def _batch(eng, drafted: _Drafted, case: Case) -> dict:
    before = _counts(eng, drafted)
    start = time.perf_counter()
    outs = eng.generate(case.prompts, case.params)
    seconds = time.perf_counter() - start
    n = sum(len(o.token_ids) for o in outs)
    fig = dict(tokens=n, seconds=seconds, tps=n / seconds, ids=[list(o.token_ids) for o in outs], text=None)
    return fig | _spec_delta(before, _counts(eng, drafted))


def _spec_delta(before: tuple, after: tuple) -> dict:
    steps, proposed, accepted = (a - b for a, b in zip(after[:3], before[:3]))
    # Single stream: a step with drafts is one drafted sequence; in a batch only settle's count tells.
    rows = after[3] - before[3] if after[3] is not None else steps
    return dict(draft_steps=steps, drafted_rows=rows, proposed=proposed, accepted=accepted)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _first_diff(a: list[list[int]], b: list[list[int]]) -> int | None:
    """Where the outputs first differ (token index, over the requests in turn), or None if equal."""
    at = 0
    for x, y in zip(a, b):
        for i, (p, q) in enumerate(zip(x, y)):
            if p != q:
                return at + i
        if len(x) != len(y):
            return at + min(len(x), len(y))
        at += len(x)
    return None


def _measure(engines: dict, cases: list[Case], reps: int, echo: Callable[[str], None]) -> dict:
    """(case index, mode) -> its best run, the modes taking turns on each case, `reps` rounds."""
    best: dict = {}
    indexes: dict = {}  # (case, mode) -> a suffix index as it was when the case first ran
    for rep in range(reps):
        for i, case in enumerate(cases):
            for mode, (eng, drafted) in engines.items():
                index = _suffix_index(eng)
                if index is not None and rep == 0:
                    indexes[(i, mode)] = copy.deepcopy(index.__dict__)
                elif index is not None:
                    # A later round sees what the first saw: not this very request's output, indexed a round ago.
                    index.__dict__.update(copy.deepcopy(indexes[(i, mode)]))
                if case.workload == "concurrent":
                    fig = _batch(eng, drafted, case)
                else:
                    fig = _stream(eng, drafted, case, f"{mode}-{i}-{rep}")
                key = (i, mode)
                if key not in best or fig["tps"] > best[key]["tps"]:
                    best[key] = fig
            echo(f"  round {rep + 1}/{reps}: {case.workload} {case.name}: "
                 + ", ".join(_progress(m, best[(i, m)]) for m in engines))
    return best


def _suffix_index(eng):
    """The engine's suffix proposer (it learns from every output), or None."""
    from engine.speculative.suffix import SuffixProposer

    speculator = eng.loop.speculator
    proposer = getattr(speculator.proposer, "inner", speculator.proposer) if speculator is not None else None
    return proposer if isinstance(proposer, SuffixProposer) else None


def _progress(mode: str, fig: dict) -> str:
    acc = f", {fig['accepted']}/{fig['proposed']} drafts accepted" if fig["proposed"] else ""
    return f"{mode} {fig['tps']:.1f} tok/s{acc}"


def _rows(cases: list[Case], best: dict, modes: list[str], quantization: str, dtype: str) -> list[dict]:
    """Per workload and mode: the figures over its cases (grounded: three tasks' tokens over their decode time)."""
    rows = []
    for w in WORKLOADS:
        idx = [i for i, c in enumerate(cases) if c.workload == w]
        for mode in modes:
            figs = [best[(i, mode)] for i in idx]
            off = [best[(i, "off")] for i in idx]
            decoded = sum(f["tokens"] - (0 if w == "concurrent" else 1) for f in figs)
            seconds = sum(f["seconds"] for f in figs)
            proposed, accepted = sum(f["proposed"] for f in figs), sum(f["accepted"] for f in figs)
            drafted = sum(f["drafted_rows"] for f in figs)
            diff = _first_diff([x for f in figs for x in f["ids"]], [x for f in off for x in f["ids"]])
            rows.append(dict(workload=w, mode=mode, quantization=quantization, dtype=dtype,
                             tokens_per_s=decoded / seconds, tokens=sum(f["tokens"] for f in figs),
                             seconds=seconds, proposed=proposed, accepted=accepted, drafted_rows=drafted,
                             acceptance=accepted / proposed if proposed else None,
                             mean_accepted_len=(accepted + drafted) / drafted if drafted else None,
                             same_as_off=diff is None, first_diff=diff,
                             cases={cases[i].name: {k: v for k, v in f.items() if k != "ids"}
                                    for i, f in zip(idx, figs)}))
    for r in rows:
        if r["workload"] == "json":
            r["parses"] = all(_parses(f["text"]) for f in r["cases"].values())
    base = {r["workload"]: r["tokens_per_s"] for r in rows if r["mode"] == "off"}
    for r in rows:
        r["vs_off"] = r["tokens_per_s"] / base[r["workload"]]
        if r["mode"] != "off":
            r["target"] = TARGETS[r["workload"]]
            r["met"] = r["vs_off"] >= r["target"]
    return rows


def _llamacpp(server_bin: str | None, model: str, cases: list[Case], best: dict, reps: int, out: Path,
              echo: Callable[[str], None]) -> dict:
    """llama.cpp's server on the grounded tasks, one at a time, as many tokens as off made, greedy -> its figures,
    or {"status": "unavailable", "note": why}."""
    import torch

    from bench import llamacpp_peer
    from engine.weights.loader import gguf_source

    grounded = [(i, c) for i, c in enumerate(cases) if c.workload == "grounded"]
    threads = torch.get_num_threads()
    try:
        binary = llamacpp_peer.find_server(server_bin)
        gguf = gguf_source(model)
        if gguf is None:
            raise llamacpp_peer.Unavailable(f"{model} is not a GGUF file: llama.cpp runs GGUF only")
        ctx = max(len(c.prompts[0]) + best[(i, "off")]["tokens"] for i, c in grounded) + BLOCK_SIZE
        echo(f"  starting llama-server (1 slot of {ctx} tokens, {threads} threads) on {gguf.name}")
        out.mkdir(parents=True, exist_ok=True)
        server = llamacpp_peer.Server(binary, str(gguf), threads, 1, ctx, out / "llamacpp.log")
    except llamacpp_peer.Unavailable as e:
        echo(f"  llama.cpp unavailable: {e}")
        return {"status": "unavailable", "note": str(e)}
    tasks: dict = {}
    try:
        server.complete(grounded[0][1].prompts[0][:64], 4)  # warm-up: its first-call costs
        for _ in range(reps):
            for i, c in grounded:
                res = server.complete(c.prompts[0], best[(i, "off")]["tokens"])
                t = res.get("timings", {})
                fig = {"tokens": int(t.get("predicted_n", 0)), "seconds": float(t.get("predicted_ms", 0)) / 1e3}
                if c.name not in tasks or fig["tokens"] / fig["seconds"] > tasks[c.name]["tps"]:
                    tasks[c.name] = fig | {"tps": fig["tokens"] / fig["seconds"]}
    finally:
        server.close()
    tokens, seconds = sum(f["tokens"] for f in tasks.values()), sum(f["seconds"] for f in tasks.values())
    return {"status": "ok", "tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "threads": threads, "gguf": str(gguf), "startup_s": server.startup_s, "cases": tasks}


def run_spec(model: str, device: str | None = None, dtype: str | None = None, quantizations: tuple[str, ...] = ("auto",),
             quick: bool = False, out_dir: str | Path = "bench/results", k: int | None = None, reps: int | None = None,
             llamacpp_server: str | None = None, seed: int = 0, echo: Callable[[str], None] = print,
             modes: list[str] | None = None, num_kv_blocks: int | None = None) -> dict:
    """Speculation off against each of `modes` (default: every mode the engine offers), for each quantization in
    turn; llama.cpp on the first one's off lengths -> what spec.json holds. num_kv_blocks: each engine's cache
    (default: every sequence of the largest case at its full length)."""
    import torch

    from bench.report import machine, write_json
    from engine import EngineConfig
    from engine.config import SPECULATIVE

    k = k or EngineConfig.num_speculative_tokens
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    reps = reps or (1 if quick else REPS)
    modes = ["off", *(m for m in modes or SPECULATIVE if m != "off")]
    data: dict = {"machine": machine(device), "model": model, "device": device, "k": k, "reps": reps, "quick": quick,
                  "modes": modes, "threads": torch.get_num_threads(), "rows": [], "errors": {},
                  "load_average": {"start": os.getloadavg()}}  # 1, 5, 15 minutes: how busy the machine was
    echo(f"pagedq bench spec: {model} on {device}, {torch.get_num_threads()} threads; modes {', '.join(modes)}, "
         f"k={k}, best of {reps}")
    llama = None
    for q in quantizations:
        rows, cases, best = _one_quantization(model, device, dtype, q, modes, k, reps, quick, seed, num_kv_blocks,
                                              data, echo)
        data["rows"] += rows
        if llama is None and best is not None:
            llama = data["llamacpp"] = _llamacpp(llamacpp_server, model, cases, best, reps, Path(out_dir), echo)
            data["llamacpp"]["quantization_of_off_lengths"] = q
    for r in data["rows"]:
        if r["workload"] == "grounded" and llama and llama["status"] == "ok":
            r["vs_llamacpp"] = r["tokens_per_s"] / llama["tokens_per_s"]
            r["met_vs_llamacpp"] = r["vs_llamacpp"] >= LLAMACPP_TARGET
    data["load_average"]["end"] = os.getloadavg()
    data["table"] = table(data)
    echo("\n" + data["table"])
    echo(f"\nwrote {write_json(data, out_dir, 'spec.json')}")
    return data


def _one_quantization(model, device, dtype, q, modes, k, reps, quick, seed, num_kv_blocks, data, echo):
    """Every mode's engine under quantization q, the cases measured in turns -> (rows, cases, best runs)."""
    import gc

    from engine.weights.loader import gguf_source

    cases = _cases(model, quick, seed)
    seqs = max(64, max(len(c.prompts) for c in cases))
    blocks = num_kv_blocks or _kv_blocks(cases, k, seqs)
    engines = {}
    for mode in modes:
        try:
            eng = _engine(model, device, dtype, q, mode, k, seqs, blocks)
        except Exception as e:  # a mode that cannot run here (a draft model missing) leaves the others standing
            if mode == "off":
                raise
            data["errors"][f"{q}/{mode}"] = f"{type(e).__name__}: {e}"[:300]
            echo(f"  {mode} ({q}): did not start: {data['errors'][f'{q}/{mode}']}")
            continue
        _warm(eng, cases)
        engines[mode] = (eng, _Drafted(eng))
    dtype_used = engines["off"][0].config.dtype
    echo(f"  quantization={q}, dtype {dtype_used}: {len(engines)} engines of {blocks} KV blocks, {seqs} sequences")
    best = _measure(engines, cases, reps, echo)
    rows = _rows(cases, best, list(engines), q, dtype_used)
    for r in rows:
        r["gguf"] = gguf_source(model) is not None
    del engines
    gc.collect()
    return rows, cases, best


def _warm(eng, cases: list[Case]) -> None:
    """First-call costs out of the figures: a prefill of the report's length, some verify steps, a batch."""
    from engine import SamplingParams

    greedy = SamplingParams(max_tokens=8, temperature=0)
    eng.generate([cases[0].prompts[0]], greedy)
    eng.generate(cases[-1].prompts[:4], greedy)


def table(data: dict) -> str:
    """The markdown table of a run: a row per workload and mode (llama.cpp under grounded)."""
    llama = data.get("llamacpp") or {}
    load = data.get("load_average", {}).get("start")
    lines = [f"{data['model']}, {data['machine'].get('cpu', '?')}, {data['threads']} threads, k={data['k']}, "
             f"best of {data['reps']}; tokens/s: decode (single stream) or output (concurrent)"
             + (f"; load average at the start {load[0]:.1f}" if load else ""),
             "",
             "| workload | weights | mode | tok/s | vs off (target) | acceptance | mean accepted length "
             "| same tokens as off | vs llama.cpp (target 3x) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        same = "yes" if r["same_as_off"] else f"no (from token {r['first_diff']})"
        acc = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        mal = f"{r['mean_accepted_len']:.2f}" if r["mean_accepted_len"] is not None else "-"
        vs = f"{r['vs_llamacpp']:.2f}x" if "vs_llamacpp" in r else "-"
        ratio = f"{r['vs_off']:.2f}x" + (f" (>= {r['target']}x: {'met' if r['met'] else 'missed'})"
                                          if "target" in r else "")
        lines.append(f"| {r['workload']} | {_weights(r)} | {r['mode']} | {r['tokens_per_s']:.1f} | {ratio} "
                     f"| {acc} | {mal} | {same if r['mode'] != 'off' else ''} | {vs} |")
    if llama.get("status") == "ok":
        lines.append(f"| grounded | GGUF as stored | llama.cpp server | {llama['tokens_per_s']:.1f} | | | | | 1.00x |")
    elif llama:
        lines.append(f"\nllama.cpp: {llama['status']}: {llama['note']}")
    for key, why in data["errors"].items():
        lines.append(f"\n{key}: did not run: {why}")
    return "\n".join(lines)


def _weights(row: dict) -> str:
    q, dtype = row["quantization"], row["dtype"]
    if not row.get("gguf"):
        return dtype if q in ("auto", "none") else f"{q}, {dtype}"
    return {"auto": f"GGUF blocks as stored, {dtype}", "none": f"GGUF dequantized, {dtype}"}.get(q, f"{q}, {dtype}")


def main() -> None:
    from engine.config import DEFAULT_MODEL, SPECULATIVE

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quantization", nargs="+", default=["auto"],
                    help="one run per value: auto (a GGUF's blocks as stored) and/or none (dequantized)")
    ap.add_argument("--mode", nargs="+", choices=SPECULATIVE[1:], default=None,
                    help="modes run against off (default: all of them)")
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="each engine's KV cache (default: sized to fit)")
    ap.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: the engine's)")
    ap.add_argument("--reps", type=int, default=None, help=f"rounds, each run kept at its best (default {REPS})")
    ap.add_argument("--quick", action="store_true", help="a smoke run: short outputs, a few requests, one round")
    ap.add_argument("--llamacpp-server", default=None, help="llama-server binary (or $PAGEDQ_LLAMACPP_SERVER)")
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    run_spec(args.model, args.device, args.dtype, tuple(args.quantization), args.quick, args.out_dir, args.k,
             args.reps, args.llamacpp_server, modes=args.mode, num_kv_blocks=args.num_kv_blocks)


if __name__ == "__main__":
    main()
