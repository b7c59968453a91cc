"""Linear layers whose weights stay quantized on the GPU: out = x @ W.T (+ bias), W dequantized tile by tile in
registers by a Triton kernel, never written out in float.

The layout (`QuantWeight`, made from pagedq_kernels.quant_layout.Blocks: weight = scale * u + min per block of inputs):
- u, [N, K] uint8 for 8 bits; [N, K / 2] uint8 for 4 bits, input 2i in the low nibble and 2i + 1 in the high one.
  Rows are output columns and contiguous along K, so a tile's loads run along memory.
- scale and min, [N, K / block], float16 where every value of the layer is exact in float16 (Q8_0, Q4_0 and Q4_1
  store float16 d and m, and int8/int4 made at load round theirs to float16s: 9, 5, 5, 9 and 5 bits a weight in
  all) and float32 otherwise (Q4_K's and Q6_K's d times a 6- or 8-bit scale: 6 and 12 bits a weight), so that no
  format loses a bit to save a byte. The price is over the files' own 8.5, 4.5, 5, 4.5 and 6.6 bits: a min stored
  beside every scale, and float32 scales.

Rounding: the kernel computes u * scale + min in float32. For every GGUF format u * scale is exact in float32 (at
most 24 significant bits: Q6_K's 6-bit u times float16 d times a 7-bit scale), so the weight equals
Blocks.dequantize()'s bit for bit whether or not the compiler fuses the multiply-add, and so for int8 and int4
(float16 scales) and AWQ/GPTQ (a float16 scale times small integers); only a scale of any float32 could make a
fused multiply-add differ by an ulp of float32. The weight is then rounded to x's dtype (float16/bfloat16;
float32 keeps it) and multiplied on tensor cores with float32 sums: the result of F.linear(x, dequantized weight in
x's dtype), up to summation order.
float32 x multiplies in IEEE float32 (never TF32), as the attention kernels do.

Two launch shapes of one kernel:
- decode (M <= DECODE_ROWS): a 16-row tile (the smallest tensor-core M), and K split over enough programs to fill
  the GPU twice over (132 SMs on an H200): a matrix-vector product is memory-bound, and N / BLOCK_N programs alone
  leave most SMs idle for a small model. Splits write float32 partials that torch sums (deterministic, no atomics).
- prefill: 64 x 64 tiles over M and N, K in steps of 64, bias and the cast in the epilogue.
float32 inputs take smaller tiles (`tiles`). Every tl.dot has K = 32 or 64 (Hopper needs K >= 16). A tile's scales
and mins are loaded once per block and repeated in registers. Launch choices depend on shapes only: no host sync.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from torch import nn

from pagedq_kernels.quant_layout import Blocks, exact_in_half
from pagedq_kernels.triton_ops import _num_sms

DECODE_ROWS = 16  # rows up to which the split-K decode shape runs
MAX_SPLITS = 16


@triton.jit
def _per_input(ptr, ok, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's scales (or mins), loaded once per block [BLOCK_K / GROUP, BLOCK_N] and repeated to every input of
    the block [BLOCK_K, BLOCK_N] in registers."""
    v = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    return tl.reshape(tl.broadcast_to(v[:, None, :], (BLOCK_K // GROUP, GROUP, BLOCK_N)), (BLOCK_K, BLOCK_N))


@triton.jit
def _weights(u_ptr, s_ptr, m_ptr, k0, offs_n, N, K, stride_u, stride_s, BITS: tl.constexpr, GROUP: tl.constexpr,
             BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The float32 weights of inputs k0 .. k0 + BLOCK_K (k0 a multiple of BLOCK_K, itself of GROUP) as W.T's
    [BLOCK_K, BLOCK_N] tile; zeros outside N x K."""
    k = k0 + tl.arange(0, BLOCK_K)[:, None]
    n = offs_n[None, :].to(tl.int64)  # n * stride overflows int32 in a large lm_head
    ok = (k < K) & (n < N)
    if BITS == 4:
        # Each byte is loaded for both its inputs; the second load hits L1, and no interleave is needed.
        byte = tl.load(u_ptr + n * stride_u + k // 2, mask=ok, other=0).to(tl.int32)
        u = (byte >> ((k % 2) * 4)) & 15
    else:
        u = tl.load(u_ptr + n * stride_u + k, mask=ok, other=0).to(tl.int32)
    kb = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)[:, None]
    at = n * stride_s + kb
    okb = (kb * GROUP < K) & (n < N)  # K is a multiple of GROUP: a block is all in or all out
    s = _per_input(s_ptr + at, okb, GROUP, BLOCK_K, BLOCK_N)
    m = _per_input(m_ptr + at, okb, GROUP, BLOCK_K, BLOCK_N)
    return u.to(tl.float32) * s + m


@triton.jit
def _quant_matmul_kernel(
    x_ptr, u_ptr, s_ptr, m_ptr, bias_ptr, out_ptr,
    M, N, K, k_span, stride_xm, stride_u, stride_s, stride_om, stride_split,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_m[:, None].to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = split * k_span
    for k0 in range(start, tl.minimum(start + k_span, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=(rows < M) & (offs_k[None, :] < K), other=0.0)
        w = _weights(u_ptr, s_ptr, m_ptr, k0, offs_n, N, K, stride_u, stride_s, BITS, GROUP, BLOCK_K,
                     BLOCK_N).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    ok = (rows < M) & (offs_n[None, :] < N)
    if SPLIT:  # a float32 partial of this K span; the caller sums the spans and adds the bias
        tl.store(out_ptr + split.to(tl.int64) * stride_split + rows * stride_om + offs_n[None, :], acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
        tl.store(out_ptr + rows * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass
class QuantWeight:
    """A layer's quantized weights on the device, in the kernel's layout (module docstring)."""

    u: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    bits: int
    block: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.u, self.scale, self.min))


def _per_block_dtype(blocks: Blocks) -> np.dtype:
    """float16 where it holds every scale and min exactly, else float32."""
    return np.float16 if exact_in_half(blocks.scale) and exact_in_half(blocks.min) else np.float32


def device_weight(blocks: Blocks, device: torch.device | str) -> QuantWeight:
    """`blocks` in the kernel's layout on `device`."""
    n, k = blocks.u.shape
    if blocks.bits not in (4, 8) or blocks.block not in (16, 32) or k % blocks.block:
        raise ValueError(f"no Triton kernel for {blocks.bits}-bit blocks of {blocks.block} with K = {k} "
                         "(4 or 8 bits, blocks of 16 or 32, K a multiple of the block)")
    if blocks.scale.shape != (n, k // blocks.block) or blocks.min.shape != blocks.scale.shape:
        raise ValueError(f"scale/min of shape {blocks.scale.shape}/{blocks.min.shape} do not fit u {blocks.u.shape}")
    u = blocks.u.astype(np.uint8)
    if blocks.bits == 4:
        if int(u.max(initial=0)) > 15:
            raise ValueError("4-bit blocks hold a value above 15")
        u = u[:, 0::2] | (u[:, 1::2] << 4)
    per_block = _per_block_dtype(blocks)

    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return QuantWeight(put(u), put(blocks.scale.astype(per_block)), put(blocks.min.astype(per_block)), blocks.bits,
                       blocks.block, n, k)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def tiles(decode: bool, wide: bool) -> dict:
    """The launch's tile and warps: decode rows padded to 16 (tl.dot's minimum M), prefill 64 x 64; wide (float32
    inputs, multiplied in IEEE float32 on the FMA units) takes half the K step, and half the rows in prefill, or
    its prefill spills registers (tests/kernels/compile_triton.py's report). Every BLOCK_K is >= 16 and a multiple of 32."""
    block_k = 32 if wide else 64
    block_m = 16 if decode else 64 // (1 + wide)
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=3)


def splits_for(n: int, k: int, device: torch.device, wide: bool = False) -> tuple[int, int]:
    """(splits, K span of each, a multiple of BLOCK_K) of a decode launch: enough programs to fill the GPU twice."""
    t = tiles(True, wide)
    steps = triton.cdiv(k, t["BLOCK_K"])
    want = triton.cdiv(2 * _num_sms(device), triton.cdiv(n, t["BLOCK_N"]))
    per = triton.cdiv(steps, max(1, min(want, steps, MAX_SPLITS)))
    return triton.cdiv(steps, per), per * t["BLOCK_K"]


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float16, bfloat16 or float32) @ W.T + bias -> [..., N] in x's dtype; bias float32 [N] or None."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"quant_linear takes float16, bfloat16 or float32 inputs, not {x.dtype}")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the layer takes {w.in_features}")
    if x.device != w.u.device:
        raise ValueError(f"input on {x.device}, weights on {w.u.device}")
    dtype = x.dtype
    x2 = x.reshape(-1, w.in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if dtype == torch.bfloat16 and _interpreting():
        x2 = x2.float()  # the interpreter computes bfloat16 wrongly; a GPU runs it as it is
    m, n, k = x2.shape[0], w.out_features, w.in_features
    out = torch.empty(m, n, dtype=dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    wide = x2.dtype == torch.float32
    consts = dict(BITS=w.bits, GROUP=w.block, HAS_BIAS=bias is not None, IEEE=wide)
    bias_arg = bias if bias is not None else w.scale  # never read without HAS_BIAS
    decode = m <= DECODE_ROWS
    cfg = tiles(decode, wide)
    splits, span = splits_for(n, k, x.device, wide) if decode else (1, k)
    dest = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), splits)
    _quant_matmul_kernel[grid](
        x2, w.u, w.scale, w.min, bias_arg, dest, m, n, k, span, x2.stride(0), w.u.stride(0), w.scale.stride(0),
        n, m * n, SPLIT=splits > 1, **consts, **cfg)
    if splits > 1:
        total = dest.sum(0)
        if bias is not None:
            total += bias
        out.copy_(total)
    return out.reshape(*x.shape[:-1], n)


class TritonQuantLinear(nn.Module):
    """A linear layer on quantized weights kept on the GPU (engine.weights.quantized swaps it in)."""

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None, fmt: str, device: torch.device | str) -> None:
        super().__init__()
        self.weight_q = device_weight(blocks, device)
        self.bias = None if bias is None else bias.detach().to(device=device, dtype=torch.float32).contiguous()
        self.out_features, self.in_features = self.weight_q.out_features, self.weight_q.in_features
        self.format = fmt
        self.nbytes = self.weight_q.nbytes

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = quant_linear(x, self.weight_q, self.bias)
        if out is None:
            return y
        out.copy_(y)
        return out
