"""Section 1, kernels: store_kv and paged_attention against host-side oracles that share nothing with them,
what each compiled variant uses, and the quantized matmul (quant.py)."""

from __future__ import annotations

import ast
import dataclasses
import math

from bench.gpu_check.common import (
    TOL,
    Budget,
    _tail,
    sweep,
)
from bench.gpu_check.quant import check_quantized

KERNEL_DTYPES = ("bfloat16", "float16", "float32")
SMOKE_DTYPES = ("float16", "float32")  # the interpreter computes bfloat16 wrongly
# (Hq, Hkv), head_dim, block_size
LAYOUTS = [((9, 3), 64, 16), ((8, 2), 128, 16), ((4, 4), 64, 32), ((5, 1), 128, 32), ((32, 8), 128, 16)]
# (tokens in the cache, new tokens) per sequence
KINDS = {
    "decode": [(12, 1), (3, 1), (700, 1), (0, 1), (33, 1)],
    "prefill": [(0, 9), (0, 400), (0, 1), (0, 17)],
    "chunked": [(320, 200), (48, 5), (20, 31)],
    "mixed": [(0, 9), (6, 5), (12, 1), (3, 1), (0, 1), (900, 1), (160, 240)],
}
SMOKE_KINDS = {"decode": [(12, 1), (3, 1), (70, 1), (0, 1)], "prefill": [(0, 9), (0, 17)],
               "chunked": [(32, 20), (20, 31)], "mixed": [(0, 9), (6, 5), (12, 1), (40, 1), (16, 24)]}
SPLIT_SHAPES = [(3000, 1), (5, 1), (1290, 1)]
STORE_PADDING = 2  # rows with slot -1 after every store's real rows: they must write nothing


@dataclasses.dataclass(frozen=True)
class KernelCase:
    dtype: str
    name: str
    heads: tuple[int, int]
    head_dim: int
    block_size: int
    shapes: tuple[tuple[int, int], ...]
    segments: int | None = None  # split-K forced to this many; None: paged_attention's own choice
    padding: int = 0  # decode rows of a padded CUDA-graph batch: seq_len 0 (and slot -1)
    num_blocks: int | None = None
    first_block: int = 0


def kernel_cases(dtypes=KERNEL_DTYPES, smoke: bool = False) -> list[KernelCase]:
    """Every case, bf16 first (the CUDA default), so that a budget cut falls on the rarer dtypes."""
    kinds = SMOKE_KINDS if smoke else KINDS
    layouts = LAYOUTS[:2] if smoke else LAYOUTS
    split = ((8, 2), 64, 16, [(300, 1), (5, 1), (129, 1)]) if smoke else ((8, 2), 128, 16, SPLIT_SHAPES)
    (hq, hkv), d, bs, shapes = split
    cases = []
    for dt in dtypes:
        for heads, hd, block in layouts:
            for kind, kshapes in kinds.items():
                cases.append(KernelCase(dt, f"{heads[0]}/{heads[1]}x{hd} bs{block} {kind}", heads, hd, block,
                                        tuple(kshapes)))
        tag = f"{hq}/{hkv}x{d}"
        cases += [KernelCase(dt, f"{tag} split-K, 7 segments", (hq, hkv), d, bs, tuple(shapes), segments=7),
                  KernelCase(dt, f"{tag} split-K, 7 segments, 3 padding rows", (hq, hkv), d, bs, tuple(shapes),
                             segments=7, padding=3),
                  KernelCase(dt, f"{tag} automatic split-K, 3 padding rows", (hq, hkv), d, bs, tuple(shapes),
                             padding=3)]
        if not smoke:
            cases.append(KernelCase(dt, "4/1x64 40k-block cache, ids > 32768", (4, 1), 64, 16,
                                    ((7000, 1), (10000, 1), (64, 1)), num_blocks=40_000, first_block=32_768))
    return cases


def run_kernel_case(case: KernelCase, device: str, ops=None, seed: int = 0) -> dict:
    """store_kv then attention of one case through `ops` (the Triton ops), each against a host-side oracle."""
    import torch

    from pagedq_kernels import testing as t

    if ops is None:
        from pagedq_kernels import triton_ops as ops
    dtype = getattr(torch, case.dtype)
    hq, hkv = case.heads
    d = case.head_dim
    b = t.random_batch(hq, hkv, d, case.block_size, list(case.shapes), dtype, num_blocks=case.num_blocks,
                       first_block=case.first_block, seed=seed, device=device)
    before = (b["k_cache"].to("cpu", copy=True), b["v_cache"].to("cpu", copy=True))  # a copy on a CPU too
    # k and v as the model hands them over: views into one fused projection; then rows with slot -1
    n = b["k"].shape[0]
    fused = torch.randn(n + STORE_PADDING, hq + 2 * hkv, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    fused = fused.to(device)
    fused[:n, hq:hq + hkv] = b["k"]
    fused[:n, hq + hkv:] = b["v"]
    slots = torch.cat([b["slot_mapping"], b["slot_mapping"].new_full((STORE_PADDING,), -1)])
    ops.store_kv(fused[:, hq:hq + hkv], fused[:, hq + hkv:], b["k_cache"], b["v_cache"], slots)
    want_k, want_v = t.expected_caches(before, b)
    wrong = torch.zeros(want_k.shape[0] * want_k.shape[1], dtype=torch.bool)
    for got, want in ((b["k_cache"], want_k), (b["v_cache"], want_v)):
        wrong |= (t.as_bits(got.cpu()) != t.as_bits(want)).flatten(2).any(2).flatten()
    rows = n
    if case.padding:
        b = t.with_padding_rows(b, case.padding)
    out = (t.attend(ops, b, segments=case.segments) if case.segments else t.attend(ops, b)).cpu()
    ref = t.dense_attention(b, want_k, want_v)
    err = t.rel_err(out[:rows], ref[:rows])
    row = {"dtype": case.dtype, "case": case.name, "wrong_slots": int(wrong.sum()), "rel_err": err,
           "max_abs_err": (out[:rows].double() - ref[:rows]).abs().max().item() if math.isfinite(err) else err}
    ok = row["wrong_slots"] == 0 and err < TOL[case.dtype]
    if case.padding:
        row["padding_rows_zero"] = bool((out[rows:] == 0).all())
        ok = ok and row["padding_rows_zero"]
    row["ok"] = ok
    return row


def check_kernels(device: str, budget: Budget, model: str = "", smoke: bool = False) -> dict:
    cases = kernel_cases(SMOKE_DTYPES if smoke else KERNEL_DTYPES, smoke)
    out: dict = {"tolerance": TOL, "cases": []}
    for i, case in enumerate(sweep(budget, cases, out)):
        try:
            out["cases"].append(run_kernel_case(case, device, seed=i))
        except Exception as e:  # noqa: BLE001 (a case that crashes is a wrong case; the others still run)
            out["cases"].append({"dtype": case.dtype, "case": case.name, "ok": False,
                                 "error": f"{type(e).__name__}: {e}", "traceback": _tail(e)})
    quant = out["quantized"] = check_quantized(device, budget, smoke)  # pagedq_kernels/triton_quant.py, the same budget
    if quant.get("stopped"):
        out["stopped"] = "; ".join(filter(None, [out.get("stopped"), f"quantized: {quant['stopped']}"]))
    out["ok"] = all(c["ok"] for c in out["cases"]) and out["quantized"]["ok"]
    out["status"] = "failed" if not out["ok"] else "partial" if out.get("stopped") else "ok"
    out["compiled"] = compiled_resources()
    return out


def compiled_resources() -> list[dict] | dict:
    """What each Triton kernel variant compiled in this process uses, as the driver loaded it."""
    try:
        from triton.runtime.jit import JITFunction

        from pagedq_kernels import triton_ops, triton_quant

        rows = []
        for name, fn in [*vars(triton_ops).items(), *vars(triton_quant).items()]:
            if not isinstance(fn, JITFunction):
                continue
            for caches in getattr(fn, "device_caches", {}).values():
                for key, kernel in caches[0].items():
                    rows.append({"kernel": name, "constexprs": _constexprs(fn, key),
                                 "registers": getattr(kernel, "n_regs", None),
                                 "spills": getattr(kernel, "n_spills", None),
                                 "shared_bytes": getattr(getattr(kernel, "metadata", None), "shared", None)})
        return rows
    except Exception as e:  # noqa: BLE001 (a Triton version without these internals: say so, measure the rest)
        return {"error": f"{type(e).__name__}: {e}"}


def _constexprs(fn, key) -> dict | str:
    """The upper-case constexpr arguments of a kernel-cache key (str(specialization) + str(options))."""
    try:
        spec = ast.literal_eval(str(key)[: str(key).index("]") + 1])
        return {a: s[1] for a, s in zip(fn.arg_names, spec) if a.isupper() and s[0] == "constexpr"}
    except (ValueError, SyntaxError, IndexError, TypeError):
        return str(key)[:300]
