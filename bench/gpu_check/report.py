"""gpu-check's targets and its printed table."""

from __future__ import annotations

from bench.gpu_check.common import (
    SECTIONS,
    TOL,
)
from bench.gpu_check.quant import table_lines


def targets(data: dict) -> list[dict]:
    """The issue's targets, each with what was measured (None where its section did not run)."""
    k = data.get("kernels", {})
    shape = "9/3x64 bs16"
    bw = [r["fraction_of_copy"] for r in data.get("bandwidth", {}).get("cases", [])
          if r.get("shape", shape) == shape and r["batch"] >= 64 and r["context"] >= 2048]
    g = data.get("graphs", {})
    eq = [e["ok"] for e in g.get("equality", [])]
    checked = [r for r in g.get("cases", []) if r.get("sync_checked")]
    syncs = sum("host_sync" in r for r in checked)
    speed = g.get("speedup", {}).get("8")
    e2e = data.get("e2e", {}).get("ratios", {}).get("mixed: engine / hf-static")
    tp = data.get("tensor_parallel", {}).get("equality", {}).get("ok")
    return [
        {"target": "kernels correct in bf16, fp16 and fp32 (store_kv exact, attention within tolerance)",
         "measured": k.get("ok"), "met": k.get("ok")},
        {"target": "decode attention >= 70% of copy bandwidth (SmolLM2 shape, batch >= 64, context >= 2048), worst",
         "measured": min(bw) if bw else None, "met": min(bw) >= 0.7 if bw else None},
        {"target": "CUDA graph replay gives eager's greedy tokens (or a near tie)",
         "measured": all(eq) if eq else None, "met": all(eq) if eq else None},
        {"target": "no host sync in the steady decode loop (eager and graphs)",
         "measured": f"{syncs} of {len(checked)} loops" if checked else None,
         "met": syncs == 0 if checked else None},
        {"target": "CUDA graphs >= 1.5x eager decode steps/s at batch 8", "measured": speed,
         "met": speed >= 1.5 if speed else None},
        {"target": "engine >= 3x transformers static batching on mixed", "measured": e2e,
         "met": e2e >= 3 if e2e else None},
        {"target": "tensor parallelism gives one device's greedy tokens (or a near tie)", "measured": tp, "met": tp},
    ]


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def _section_line(name: str, s: dict) -> str:
    line = f"{name}: {s['status']}, {_fmt(s.get('seconds'))} s of {_fmt(s.get('budget_s'))}"
    if s.get("stopped"):
        line += f" ({s['stopped']})"
    if s.get("error"):
        line += f": {s['error']}"
    return line


def table(data: dict) -> str:
    lines = [f"gpu-check on {data['device']} (torch {data['torch']}, triton {data['triton']}, "
             f"cuda {data.get('cuda')})", ""]
    lines += [_section_line(name, data[name]) for name in SECTIONS if name in data]
    lines += _kernel_lines(data.get("kernels"))
    lines += _bandwidth_lines(data.get("bandwidth"))
    lines += _graph_lines(data.get("graphs"))
    lines += _e2e_lines(data.get("e2e"))
    lines += _tensor_parallel_lines(data.get("tensor_parallel"))
    lines += ["", "target | measured | met"]
    lines += [f"{t['target']} | {_fmt(t['measured'])} | {_fmt(t['met'])}" for t in data["targets"]]
    return "\n".join(lines)


def _kernel_lines(k: dict | None) -> list[str]:
    if not (k and "cases" in k):
        return []
    lines = [""]
    for dt in TOL:
        cases = [c for c in k["cases"] if c["dtype"] == dt]
        if not cases:
            continue
        bad = [c["case"] for c in cases if not c["ok"]]
        worst = max((c for c in cases if "rel_err" in c), key=lambda c: c["rel_err"], default=None)
        lines.append(f"kernels {dt}: {len(cases)} cases, {len(bad)} wrong"
                     + (f" ({', '.join(bad[:4])})" if bad else "")
                     + (f"; worst attention rel err {_fmt(worst['rel_err'])} ({worst['case']}), "
                        f"tolerance {TOL[dt]}" if worst else "")
                     + f"; store_kv slots wrong: {sum(c.get('wrong_slots', 0) for c in cases)}")
    spills = [c for c in k.get("compiled", []) if isinstance(c, dict) and c.get("spills")]
    if spills:
        lines.append(f"compiled variants that spill: {len(spills)} (see kernels.compiled in the JSON)")
    if "quantized" in k:
        lines += table_lines(k["quantized"])
    return lines


def _bandwidth_lines(bw: dict | None) -> list[str]:
    if not (bw and bw.get("cases")):
        return []
    lines = ["", f"decode attention, fraction of copy bandwidth ({bw['copy_gb_per_s']:.0f} GB/s moved), "
                 f"{bw['dtype']}"]
    for shape in dict.fromkeys(r["shape"] for r in bw["cases"]):
        rows = [r for r in bw["cases"] if r["shape"] == shape]
        ctxs = list(dict.fromkeys(r["context"] for r in rows))
        lines.append(f"{shape:12s} batch | " + " | ".join(f"ctx {c}" for c in ctxs))
        for b in dict.fromkeys(r["batch"] for r in rows):
            cells = [next((r for r in rows if r["batch"] == b and r["context"] == c), None) for c in ctxs]
            lines.append(f"{'':12s} {b:5d} | " + " | ".join(
                f"{r['fraction_of_copy']:.0%} ({r['gb_per_s']:.0f} GB/s)" if r else "-" for r in cells))
    return lines


def _graph_lines(g: dict | None) -> list[str]:
    if not (g and "equality" in g):
        return []
    lines = [""]
    for e in g["equality"]:
        lines.append(f"graphs vs eager, {e['dtype']}: {e['equal_requests']} of {e['requests']} requests equal "
                     f"({e['tokens']} tokens); divergences: "
                     + (", ".join(f"request {d['request']} at {d['position']} (gap {_fmt(d['gap'])}"
                                  f"{'' if d['explained'] else ', NOT a tie'})" for d in e["divergences"])
                        or "none"))
    for r in g.get("cases", []):
        if "host_sync" in r:
            lines.append(f"host sync, batch {r['batch']} {'graphs' if r['graphs'] else 'eager'}: "
                         f"{r['host_sync']} at {', '.join(r['where'])}")
    for b, s in g.get("speedup", {}).items():
        rate = next(r["steps_per_s"] for r in g["cases"] if str(r["batch"]) == b and r["graphs"]
                    and "steps_per_s" in r)
        lines.append(f"decode steps/s at batch {b}: {rate:.0f} with graphs, {s:.2f}x eager")
    return lines


def _e2e_lines(e: dict | None) -> list[str]:
    if not (e and "runs" in e):
        return []
    lines = [""]
    for r in e["runs"]:
        lines.append(f"{r['workload']:6s} {r['system']:10s} {_fmt(r.get('output_tokens_per_s'))} tok/s")
    for name, ratio in e["ratios"].items():
        lines.append(f"{name}: {ratio:.2f}x")
    for err in e["errors"]:
        lines.append(f"{err['workload']} {err['system']}: {err['error']}")
    if "chat_reply" in e:
        lines.append(f"chat reply: {e['chat_reply']!r}")
    return lines


def _tensor_parallel_lines(t: dict | None) -> list[str]:
    if not t or "equality" not in t:
        return []
    e = t["equality"]
    lines = ["", f"tensor parallel x{t['size']} vs one device, {e['dtype']}: {e['equal_requests']} of {e['requests']} "
                 f"requests equal; CUDA graphs captured: {_fmt(t['captured'])}"]
    for b, s in t.get("speedup", {}).items():
        lines.append(f"decode steps/s at batch {b}: {s:.2f}x one device")
    return lines
