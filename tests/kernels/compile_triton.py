"""Compile every Triton kernel variant as a launch on an H100/H200 specializes it, without a GPU, and report what
each one uses: registers and spill stores/loads (Triton's bundled `ptxas -v`), shared memory (the compiled
kernel's metadata) and whether the loads were pipelined (cp.async in the PTX).

The launches are recorded, not run: kernels.triton_ops' store_kv, paged_attention and attention, and
kernels.triton_quant's quant_linear (every weight layout, both launch shapes), are called on CPU tensors of real
shapes with every @triton.jit kernel of the module swapped for a recorder. Triton's own launch
binder then specializes each recorded launch as the JIT does (pointers 16-byte aligned and integers divisible by
16 marked as such, integers equal to 1 made constants), so the compiled code is the code that runs; compiled
without those hints a kernel has no cp.async pipelining and a fraction of the shared memory.

`TRITON_INTERPRET=0 python3 tests/kernels/compile_triton.py [--arch 90] [--kernels all|attention|quant] [--json PATH]` prints
a table; exit status 1 when a variant does not compile. tests/kernels/test_triton_kernels.py runs the attention kernels and
holds bf16/fp16 to no spills; tests/kernels/test_triton_quant.py runs the quantized ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (Hq, Hkv, head_dim, block_size, dtypes): SmolLM2-135M, a Llama-3-8B-like layout, and head_dim 256.
SHAPES = [(9, 3, 64, 16, ("bf16", "fp16", "fp32")),
          (32, 8, 128, 16, ("bf16", "fp16", "fp32")),
          (16, 4, 256, 16, ("bf16", "fp32"))]
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, fn, launches: list) -> None:
        self.fn = fn
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


@contextlib.contextmanager
def recording(module):
    """Every @triton.jit function of `module` replaced by a recorder while inside; yields the launches."""
    from triton.runtime.jit import JITFunction

    launches: list = []
    kernels = {name: fn for name, fn in vars(module).items() if isinstance(fn, JITFunction)}
    for name, fn in kernels.items():
        setattr(module, name, _Recorder(fn, launches))
    try:
        yield launches
    finally:
        for name, fn in kernels.items():
            setattr(module, name, fn)


def shape_launches(hq: int, hkv: int, d: int, bs: int, dtype_name: str) -> list:
    """The kernel launches of one layer's store_kv and attention for a decode batch (one segment, and split-K over
    a long block table, as CUDA-graph decode runs it) and a mixed prefill + decode batch."""
    import torch

    from pagedq_kernels import triton_ops

    dtype = getattr(torch, DTYPES[dtype_name])
    cache = torch.zeros(64, bs, hkv, d, dtype=dtype)

    def batch(q_lens, lens, width):
        q = torch.zeros(sum(q_lens), hq, d, dtype=dtype)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return q, qsl, torch.tensor(lens, dtype=torch.int32), torch.zeros(len(q_lens), width, dtype=torch.int32)

    with recording(triton_ops) as launches:
        # k and v as the model passes them: v a view into the fused qkv projection, k the rotary's fresh tensor
        qkv = torch.zeros(8, hq + 2 * hkv, d, dtype=dtype)
        triton_ops.store_kv(qkv[:, hq:hq + hkv].contiguous(), qkv[:, hq + hkv:], cache, cache.clone(),
                            torch.arange(8, dtype=torch.int64))
        q, qsl, lens, table = batch([1] * 4, [40] * 4, 4)  # short block table: one segment
        triton_ops.paged_attention(q, cache, cache, qsl, lens, table, d**-0.5)
        q, qsl, lens, table = batch([1] * 4, [40] * 4, 4096 // bs)  # a graph's wide table: split-K and the merge
        assert triton_ops.num_segments(4, hkv, 4096, q.device) > 1
        triton_ops.paged_attention(q, cache, cache, qsl, lens, table, d**-0.5)
        q, qsl, lens, table = batch([37, 1, 20], [37, 50, 60], 8)  # mixed: prefill, decode, chunk behind a prefix
        triton_ops.paged_attention(q, cache, cache, qsl, lens, table, d**-0.5)
        # copy-on-write of forked continuations' blocks, every layer's keys and values in one launch
        kv = torch.zeros(2, 2, 64, bs, hkv, d, dtype=dtype)
        triton_ops.copy_blocks(kv, torch.tensor([[1, 2], [3, 4]], dtype=torch.int64))
    return launches


# (bits, block, N, K) of the quantized layouts: 4-bit blocks of 32 (Q4_*), 8-bit of 32 (Q8_0, int8) and of 16 (Q6_K,
# mixed Q4_K+Q6_K), at Llama-3-8B-like widths; a K of one step makes the decode shape's unsplit variant.
QUANT_SHAPES = [(4, 32, 4096, 4096), (8, 32, 4096, 4096), (8, 16, 4096, 4096), (8, 32, 576, 64)]


def quant_launches(dtype_name: str) -> list:
    """The launches of kernels.triton_quant.quant_linear for every layout: decode (split-K, 1 row), prefill (300
    rows, with a bias), and the unsplit decode variant."""
    import numpy as np
    import torch

    from pagedq_kernels import triton_quant
    from pagedq_kernels.quant_layout import Blocks

    dtype = getattr(torch, DTYPES[dtype_name])
    with recording(triton_quant) as launches:
        for bits, block, n, k in QUANT_SHAPES:
            scale = np.ones((n, k // block), np.float32) / 3  # not exact in float16: float32 scales, as Q4_K's
            w = triton_quant.device_weight(Blocks(np.zeros((n, k), np.uint8), scale, -scale, bits, block), "cpu")
            for rows in ((1,) if k < 256 else (1, 300)):
                bias = torch.zeros(n) if rows > 1 else None
                triton_quant.quant_linear(torch.zeros(rows, k, dtype=dtype), w, bias)
    return launches


def launch_groups(kernels: str = "all"):
    """(dtype, shape label, head_dim or None, launches) of every group of launches to compile."""
    if kernels in ("all", "attention"):
        for hq, hkv, d, bs, dtypes in SHAPES:
            for dt in dtypes:
                yield dt, f"{hq}/{hkv}x{d} bs{bs}", d, shape_launches(hq, hkv, d, bs, dt)
    if kernels in ("all", "quant"):
        for dt in DTYPES:
            yield dt, "", None, quant_launches(dt)


def specialize(fn, args, kwargs, backend):
    """(signature, constexprs, attrs, options) of a launch, from Triton's own launch binder."""
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    return fn._pack_args(backend, options, bound, specialization, options)


def _ptxas() -> str:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except (ImportError, AttributeError, TypeError):
        import triton

        return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")


def ptxas_usage(ptx: str, arch: str, fp_fusion: bool) -> dict:
    """Registers, spill bytes and stack frame of the kernel in `ptx`, from `ptxas -v` with the flags Triton uses."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [_ptxas(), "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v", "--regAllocOptLevel=2",
               f"--gpu-name={arch}", str(src), "-o", str(src.with_suffix(".o"))]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not regs or not frame:
        raise RuntimeError(f"unexpected ptxas -v output:\n{log}")
    return {"registers": int(regs[1]), "stack_frame": int(frame[1]), "spill_stores": int(frame[2]),
            "spill_loads": int(frame[3])}


def _name(fn, constexprs: dict, dtype: str, shape: str) -> str:
    c = {fn.arg_names[k[0]]: v for k, v in constexprs.items() if fn.arg_names[k[0]].isupper()}
    if fn.__name__ == "_attention_kernel":
        kind = "split-K" if c["SPLIT"] else "decode" if c["DECODE"] else "mixed"
        tiles = f"M{c['BLOCK_M']} N{c['BLOCK_N']} D{c['BLOCK_D']}"
        return f"attention {kind:7s} {shape} {dtype} ({tiles})"
    if fn.__name__ == "_quant_matmul_kernel":
        kind = "split-K" if c["SPLIT"] else "decode" if c["BLOCK_M"] == 16 else "prefill"
        tiles = f"M{c['BLOCK_M']} N{c['BLOCK_N']} K{c['BLOCK_K']}"
        return f"quant {kind:7s} {c['BITS']}-bit block {c['GROUP']} {dtype} ({tiles})"
    return f"{fn.__name__.strip('_').removesuffix('_kernel')} {shape} {dtype}"


def compile_all(arch: int = 90, echo=print, kernels: str = "all") -> list[dict]:
    """Compile every distinct variant of SHAPES' launches -> one row per variant (name, usage); raises on the
    first variant that does not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    arch_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    rows, seen = [], set()
    for dt, shape, d, launches in launch_groups(kernels):
        for fn, args, kwargs in launches:
            options, signature, constexprs, attrs = specialize(fn, args, kwargs, backend)
            key = (fn.__name__, str(signature), str(sorted(constexprs.items())), str(sorted(attrs.items())))
            if key in seen:
                continue
            seen.add(key)
            name = _name(fn, constexprs, dt, shape)
            try:
                k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                   options=options.__dict__)
            except Exception as e:
                raise RuntimeError(f"{name}: {e}") from e
            ptx = k.asm["ptx"]
            row = {"variant": name, "kernel": fn.__name__, "dtype": dt, "head_dim": d,
                   **ptxas_usage(ptx, arch_name, options.enable_fp_fusion),
                   "shared_bytes": k.metadata.shared, "cp_async": "cp.async" in ptx,
                   "hinted_args": sum(1 for v in attrs.values() if v)}
            rows.append(row)
            echo(_line(row))
    return rows


HEADER = f"{'variant':58s} {'regs':>4s} {'spill st/ld':>13s} {'stack':>6s} {'smem':>7s} cp.async"


def _line(r: dict) -> str:
    spill = f"{r['spill_stores']}/{r['spill_loads']}"
    return (f"{r['variant']:58s} {r['registers']:4d} {spill:>13s} {r['stack_frame']:6d} {r['shared_bytes']:7d} "
            f"{'yes' if r['cp_async'] else 'no'}")



def compiled_for_hopper(kernels: str, out_dir: Path) -> list[dict]:
    """For a test: run this script on `kernels` for sm_90a in a process of its own (TRITON_INTERPRET off, as on a
    GPU) -> its rows. Skips the test where Triton has no NVIDIA compiler or no ptxas; fails it where a variant does
    not compile."""
    import pytest

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    report = out_dir / "usage.json"
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--arch", "90", "--kernels", kernels, "--json",
                        str(report)], env=env, capture_output=True, text=True, timeout=600)
    if "ptxas" in r.stdout + r.stderr and "not found" in r.stdout + r.stderr:
        pytest.skip("Triton's ptxas is not available here")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(r.stdout)  # the table: registers, spills and shared memory per variant
    return json.loads(report.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    ap.add_argument("--kernels", choices=("all", "attention", "quant"), default="all",
                    help="the attention kernels (kernels.triton_ops), the quantized matmul (kernels.triton_quant), "
                         "or both")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("set TRITON_INTERPRET=0: the interpreter does not compile")
        return 2
    print(HEADER)
    try:
        rows = compile_all(args.arch, kernels=args.kernels)
    except RuntimeError as e:
        print(f"FAIL {e}")
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
