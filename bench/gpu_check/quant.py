"""gpu-check's quantized cases (part of its kernels section): pagedq_kernels/triton_quant.py on the device.

Correctness, held: every layout (4-bit blocks of 32 with float16 or float32 scales, 8-bit blocks of 32 and of 16),
bf16/fp16/fp32 inputs, a decode row count (split-K), a few rows (unsplit K) and a prefill one, an odd N, with bias,
against a float64 matmul of the same weights rounded to the input's dtype; and the weights themselves (x = rows of
an identity) equal to Blocks.dequantize()'s bit for bit. Timing, reported and never held: one decode row (and 8)
through the quantized kernel against F.linear on the bfloat16 weights, at SmolLM2-135M and Llama-3-8B widths,
timed in CUDA graphs over copies of the weights that together outgrow the L2.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from bench.gpu_check.bandwidth import ROTATE_BYTES, per_call
from bench.gpu_check.common import TOL, Budget, _sync, _tail, sweep

# (name, bits, block, scales exact in float16): Q4_0/Q8_0-like keep float16 scales, K-quant-like float32 ones
LAYOUTS = [("Q4_0-like", 4, 32, True), ("Q4_K-like", 4, 32, False), ("Q8_0-like", 8, 32, True),
           ("Q6_K-like", 8, 16, False)]
ROWS = (1, 7, 300)  # decode (split-K), a few rows, prefill
SMOKE_ROWS = (1, 17)
# (what, N, K): decode-shaped products of the models gpu-check runs
TIMED = [("SmolLM2-135M gate_up", 3072, 576), ("Llama-3-8B qkv", 6144, 4096), ("Llama-3-8B gate_up", 28672, 4096),
         ("Llama-3-8B down", 4096, 14336)]
TIMED_LAYOUTS = ("Q4_0-like", "Q8_0-like")


def make_blocks(bits: int, block: int, exact16: bool, n: int, k: int, seed: int = 0):
    """Random Blocks as a GGUF reader makes them: scale a float16 d (times a 6-bit integer unless exact16), min
    -2**(bits - 1) scale."""
    from pagedq_kernels.quant_layout import Blocks

    rng = np.random.default_rng(seed)
    d = (rng.random((n, k // block)) * 1e-3 + 1e-4).astype(np.float16).astype(np.float32)
    scale = d if exact16 else d * rng.integers(1, 64, d.shape).astype(np.float32)
    u = rng.integers(0, 2**bits, (n, k), dtype=np.uint8)
    return Blocks(u, scale, -(2 ** (bits - 1)) * scale, bits, block)


def _case(device: str, layout: tuple, dtype_name: str, rows: int, n: int, k: int, seed: int) -> dict:
    import torch
    import torch.nn.functional as F

    from pagedq_kernels import triton_quant

    name, bits, block, exact16 = layout
    blocks = make_blocks(bits, block, exact16, n, k, seed)
    w = triton_quant.device_weight(blocks, device)
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    bias = torch.randn(n, generator=g).to(device)
    got = triton_quant.quant_linear(x, w, bias)
    _sync(device)
    ref = F.linear(x.double(), torch.from_numpy(blocks.dequantize()).to(device).to(dtype).double(), bias.double())
    err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    return {"case": f"{name} {rows}x{k} -> {n}", "dtype": dtype_name, "scale_dtype": str(w.scale.dtype)[6:],
            "rel_err": err, "ok": math.isfinite(err) and err < TOL[dtype_name]}


def _exact(device: str, layout: tuple, k: int = 256) -> dict:
    import torch

    from pagedq_kernels import triton_quant

    name, bits, block, exact16 = layout
    blocks = make_blocks(bits, block, exact16, 72, k, seed=k)
    w = triton_quant.device_weight(blocks, device)
    want = torch.from_numpy(blocks.dequantize()).T.to(device)
    eye = torch.eye(k, device=device)
    rows = torch.arange(3, k, k // 16, device=device)
    same = torch.equal(triton_quant.quant_linear(eye, w), want) and torch.equal(
        triton_quant.quant_linear(eye[rows], w), want[rows])
    return {"case": f"{name} weights equal Blocks.dequantize()", "dtype": "float32", "ok": bool(same)}


def _copies(device: str, nbytes: int) -> int:
    """Copies of a weight whose calls, taken in turn, read more than the L2 holds (one on a CPU)."""
    return max(1, min(8, math.ceil(ROTATE_BYTES / nbytes))) if device.startswith("cuda") else 1


def _timing(device: str, what: str, n: int, k: int, layout: tuple, rows: int) -> dict:
    """Microseconds a call of the quantized kernel and of F.linear on bfloat16 weights (float16 on a CPU)."""
    import torch
    import torch.nn.functional as F

    from pagedq_kernels import triton_quant

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float16
    name, bits, block, exact16 = layout
    w = triton_quant.device_weight(make_blocks(bits, block, exact16, n, k), device)
    quant = [w] + [dataclasses.replace(w, u=w.u.clone(), scale=w.scale.clone(), min=w.min.clone())
                   for _ in range(_copies(device, w.nbytes) - 1)]
    dense = [torch.randn(n, k, device=device).to(dtype) for _ in range(_copies(device, n * k * dtype.itemsize))]
    x = torch.randn(rows, k, device=device).to(dtype)
    q_s, _ = per_call([functools.partial(triton_quant.quant_linear, x, wi) for wi in quant], device)
    f_s, _ = per_call([functools.partial(F.linear, x, wi) for wi in dense], device)
    return {"what": what, "layout": name, "rows": rows, "N": n, "K": k, "dtype": str(dtype)[6:],
            "quantized_us": q_s * 1e6, "float_us": f_s * 1e6, "speedup": f_s / q_s,
            "quantized_gb_per_s": w.nbytes / q_s / 1e9, "float_gb_per_s": n * k * dtype.itemsize / f_s / 1e9}


def check_quantized(device: str, budget: Budget, smoke: bool = False) -> dict:
    """The quantized cases and timings; "ok" is False where any case is wrong (timings never fail it)."""
    rows = SMOKE_ROWS if smoke else ROWS
    dtypes = ("float16", "float32") if smoke else ("bfloat16", "float16", "float32")  # interpreter: no bf16
    n, k = (70, 96) if smoke else (1000, 4096)
    out: dict = {"tolerance": TOL, "cases": [], "timings": [],
                 "timing": "CUDA graph of calls over weight copies that outgrow the L2, median of 10 replays"}
    jobs = [functools.partial(_exact, device, layout) for layout in LAYOUTS]
    jobs += [functools.partial(_case, device, layout, dt, r, n, k, seed=i)
             for i, (layout, dt, r) in enumerate((la, dt, r) for dt in dtypes for la in LAYOUTS for r in rows)]
    for job in sweep(budget, jobs, out):
        try:
            out["cases"].append(job())
        except Exception as e:  # noqa: BLE001 (a case that crashes is a wrong case; the others still run)
            out["cases"].append({"case": repr(job.args[1:])[:120], "ok": False, "error": f"{type(e).__name__}: {e}",
                                 "traceback": _tail(e)})
    out["ok"] = all(c["ok"] for c in out["cases"])
    timed = [("toy", 64, 64)] if smoke else TIMED
    layouts = {la[0]: la for la in LAYOUTS}
    plan = [(t, layouts[name], r) for t in timed for name in TIMED_LAYOUTS for r in (1, 8)]
    for (what, tn, tk), layout, r in sweep(budget, plan, out, "timings"):
        try:
            out["timings"].append(_timing(device, what, tn, tk, layout, r))
        except Exception as e:  # noqa: BLE001 (a timing is a report: its failure is one too, not a wrong result)
            out["timings"].append({"what": what, "layout": layout[0], "error": f"{type(e).__name__}: {e}"})
    return out


def table_lines(q: dict) -> list[str]:
    """gpu-check's table lines of the quantized cases and timings."""
    bad = [f"{c['case']} {c.get('dtype', '')}" for c in q["cases"] if not c["ok"]]
    worst = max((c for c in q["cases"] if "rel_err" in c), key=lambda c: c["rel_err"], default=None)
    lines = [f"quantized matmul: {len(q['cases'])} cases, {len(bad)} wrong"
             + (f" ({', '.join(bad[:4])})" if bad else "")
             + (f"; worst rel err {worst['rel_err']:.2g} ({worst['case']} {worst['dtype']})" if worst else "")]
    for t in q["timings"]:
        if "error" in t:
            lines.append(f"  {t['what']} {t['layout']}: {t['error']}")
        else:
            lines.append(f"  {t['what']} {t['layout']} x{t['rows']}: {t['quantized_us']:.1f} us "
                         f"({t['quantized_gb_per_s']:.0f} GB/s) vs {t['dtype']} F.linear {t['float_us']:.1f} us: "
                         f"{t['speedup']:.2f}x")
    return lines
