"""Compile every Triton kernel variant for a GPU target without a GPU (Triton ships ptxas): catches what the
interpreter lets through and the compiler refuses (a tl.dot under 16, a non-constexpr global, a type error).

`TRITON_INTERPRET=0 python3 tests/compile_triton.py [--arch 90]` prints one line per variant; exit status 1 on the
first failure.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (Hq, Hkv, head_dim, block_size, dtype): SmolLM2's shape in bf16, a Llama-8B-like one, fp32 through the IEEE path
SHAPES = [(9, 3, 64, 16, "bf16"), (32, 8, 128, 32, "bf16"), (5, 1, 128, 16, "fp32")]


def variants():
    import triton

    from kernels import triton_ops as k

    for hq, hkv, d, bs, dt in SHAPES:
        p = "*" + dt
        group = hq // hkv
        for decode, split in ((True, False), (True, True), (False, False)):
            block_m, block_q, block_n, block_d = k.tiles_for(group, d, decode)
            consts = dict(NUM_HEADS=hq, GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=bs, BLOCK_M=block_m,
                          BLOCK_Q=block_q, BLOCK_N=block_n, SEGMENTS_CAP=k.MAX_SEGMENTS, DECODE=decode,
                          SPLIT=split, IEEE=dt == "fp32")
            types = dict(q_ptr=p, k_ptr=p, v_ptr=p, out_ptr=p, ws_acc_ptr="*fp32", ws_m_ptr="*fp32",
                         ws_l_ptr="*fp32", qsl_ptr="*i32", lens_ptr="*i32", table_ptr="*i32", scale_log2="fp32")
            yield f"attention {hq}/{hkv}x{d} bs{bs} {dt} decode={decode} split={split}", k._attention_kernel, \
                types, consts
        yield f"merge {hq}x{d} {dt}", k._merge_kernel, \
            dict(ws_acc_ptr="*fp32", ws_m_ptr="*fp32", ws_l_ptr="*fp32", out_ptr=p), \
            dict(NUM_HEADS=hq, HEAD_DIM=d, BLOCK_D=block_d, SEGMENTS_CAP=k.MAX_SEGMENTS)
        yield f"store_kv {hkv}x{d} bs{bs} {dt}", k._store_kv_kernel, \
            dict(k_ptr=p, v_ptr=p, kc_ptr=p, vc_ptr=p, slot_ptr="*i64"), \
            dict(NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=block_d, BLOCK_SIZE=bs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("set TRITON_INTERPRET=0: the interpreter does not compile")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    for name, fn, types, consts in variants():
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                           options={"num_warps": 4})
        except Exception as e:  # noqa: BLE001 (report which variant, then fail)
            print(f"FAIL {name}: {e}")
            return 1
        print(f"ok   {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
