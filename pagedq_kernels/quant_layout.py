"""Quantized weights in the layout of pagedq_kernels/cpu_quant.cpp, made from GGUF blocks or float weights.

Every format is first read as the same three arrays, which hold the weights exactly: each weight is
scale * u + min, u an unsigned integer of `bits` bits ([N, K] uint8), scale and min float32 per row and block of
`block` inputs ([N, K / block]). A GGUF format maps onto them without rounding (its scales are float16, or float16
times a 6- or 8-bit integer: exact in float32):

  Q8_0  blocks of 32: d, 32 int8 q             -> u = q + 128, scale d, min -128 d          (8 bits, block 32)
  Q4_0  blocks of 32: d, 32 4-bit q            -> u = q, scale d, min -8 d                  (4 bits, block 32)
  Q4_1  blocks of 32: d, m, 32 4-bit q         -> u = q, scale d, min m                     (4 bits, block 32)
  Q4_K  256: d, dmin, 8 x 6-bit (sc, m), q     -> per 32: scale d sc, min -dmin m           (4 bits, block 32)
  Q5_0  blocks of 32: d, 32 5-bit q            -> u = q, scale d, min -16 d                 (8 bits, block 32)
  Q5_1  blocks of 32: d, m, 32 5-bit q         -> u = q, scale d, min m                     (8 bits, block 32)
  Q5_K  256: as Q4_K, with a fifth bit a value -> per 32: scale d sc, min -dmin m           (8 bits, block 32)
  Q6_K  256: 6-bit q (low 4 + high 2 bits), 16 int8 sc, d -> per 16: u = q, scale d sc, min -32 d sc (8 bits, 16)

`pack` then lays them out in panels of 16 output columns for the kernel. The gguf package's dequantizers are the
tests' oracle for the readers; they are not used here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COLS = 16  # output columns a panel (pagedq_kernels/cpu_quant.cpp's kCols)


@dataclass
class Blocks:
    """Weights as scale * u + min per block of inputs."""

    u: np.ndarray  # [N, K] uint8, values below 2**bits
    scale: np.ndarray  # [N, K / block] float32
    min: np.ndarray  # [N, K / block] float32
    bits: int
    block: int

    def dequantize(self) -> np.ndarray:
        """[N, K] float32: what the kernel multiplies by."""
        n, k = self.u.shape
        u = self.u.reshape(n, k // self.block, self.block).astype(np.float32)
        return (u * self.scale[..., None] + self.min[..., None]).reshape(n, k)

    def rows(self, order: np.ndarray) -> Blocks:
        """These weights with their rows (output columns) in `order`."""
        return Blocks(self.u[order], self.scale[order], self.min[order], self.bits, self.block)


def stack(parts: list[Blocks]) -> Blocks:
    """Row-stacked blocks in the widest layout of the parts (4 bits fit in 8; a block of 32 is two of 16): a fused
    layer (qkv, gate_up) whose parts differ in format, still exact."""
    bits, block = max(p.bits for p in parts), min(p.block for p in parts)

    def widen(p: Blocks) -> Blocks:
        repeat = p.block // block
        return Blocks(p.u, np.repeat(p.scale, repeat, 1), np.repeat(p.min, repeat, 1), bits, block)

    wide = [widen(p) for p in parts]
    return Blocks(np.concatenate([p.u for p in wide]), np.concatenate([p.scale for p in wide]),
                  np.concatenate([p.min for p in wide]), bits, block)


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32 [N, blocks]."""
    return raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """A GGUF tensor's bytes [N, row bytes] as [N, blocks, block bytes]."""
    n = raw.shape[0]
    return raw.reshape(n, -1, block_bytes)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block -> its 32 values: the low nibbles are values 0-15, the high ones 16-31 (Q4_0, Q4_1)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def read_q8_0(raw: np.ndarray) -> Blocks:
    b = _blocks(raw, 34)
    d = _f16(b, 0)
    u = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return Blocks(u.reshape(raw.shape[0], -1), d, -128 * d, 8, 32)


def read_q4_0(raw: np.ndarray) -> Blocks:
    b = _blocks(raw, 18)
    d = _f16(b, 0)
    return Blocks(_nibbles(b[..., 2:]).reshape(raw.shape[0], -1), d, -8 * d, 4, 32)


def read_q4_1(raw: np.ndarray) -> Blocks:
    b = _blocks(raw, 20)
    return Blocks(_nibbles(b[..., 4:]).reshape(raw.shape[0], -1), _f16(b, 0), _f16(b, 2), 4, 32)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes of high bits -> bit j of the little-endian word for value j, as [..., 32] uint8."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def read_q5_0(raw: np.ndarray) -> Blocks:
    b = _blocks(raw, 22)
    d = _f16(b, 0)
    u = _nibbles(b[..., 6:]) | (_fifth_bits(b[..., 2:6]) << 4)
    return Blocks(u.reshape(raw.shape[0], -1), d, -16 * d, 8, 32)


def read_q5_1(raw: np.ndarray) -> Blocks:
    b = _blocks(raw, 24)
    u = _nibbles(b[..., 8:]) | (_fifth_bits(b[..., 4:8]) << 4)
    return Blocks(u.reshape(raw.shape[0], -1), _f16(b, 0), _f16(b, 2), 8, 32)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of scales -> the 8 sub-blocks' 6-bit scales and mins, [..., 8] each. Sub-blocks 0-3: the low 6
    bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: the nibbles of bytes 8-11, their top 2 bits from the top 2 bits
    of bytes 0-3 (scales) and 4-7 (mins)."""
    s = s.astype(np.uint16)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return (np.concatenate([low_sc, high_sc], -1).astype(np.float32),
            np.concatenate([low_m, high_m], -1).astype(np.float32))


def read_q4_k(raw: np.ndarray) -> Blocks:
    b = _blocks(raw, 144)
    n, nb = b.shape[:2]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k4_scales(b[..., 4:16])
    qs = b[..., 16:].reshape(n, nb, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low nibbles), 2c + 1 (high)
    u = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb * 256)
    return Blocks(u, (d[..., None] * sc).reshape(n, -1), (-dmin[..., None] * m).reshape(n, -1), 4, 32)


def read_q5_k(raw: np.ndarray) -> Blocks:
    b = _blocks(raw, 176)
    n, nb = b.shape[:2]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k4_scales(b[..., 4:16])
    qh = b[..., 16:48]  # value l of sub-block s: bit s of byte l
    qs = b[..., 48:].reshape(n, nb, 4, 32)  # as Q4_K's: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    low = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nb, 8, 32)
    high = np.stack([(qh >> s) & 1 for s in range(8)], axis=2)
    u = (low | (high << 4)).reshape(n, nb * 256)
    return Blocks(u, (d[..., None] * sc).reshape(n, -1), (-dmin[..., None] * m).reshape(n, -1), 8, 32)


def read_q6_k(raw: np.ndarray) -> Blocks:
    b = _blocks(raw, 210)
    n, nb = b.shape[:2]
    ql = b[..., :128].reshape(n, nb, 2, 64)  # per half of 128 values: 64 bytes of low 4 bits
    qh = b[..., 128:192].reshape(n, nb, 2, 32)  # and 32 bytes of high 2 bits
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b, 208)
    # Values 32 j + l of a half (j = 0-3, l = 0-31): low bits from ql[l] (j 0, 2) or ql[l + 32] (j 1, 3), low
    # nibble for j 0-1, high for 2-3; high bits from qh[l], bits 2j and 2j + 1.
    low = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
    high = np.stack([(qh >> (2 * j)) & 3 for j in range(4)], axis=3)
    u = (low | (high << 4)).reshape(n, nb * 256)
    scale = (d[..., None] * sc).reshape(n, -1)
    return Blocks(u, scale, -32 * scale, 8, 16)


READERS = {"Q8_0": read_q8_0, "Q4_0": read_q4_0, "Q4_1": read_q4_1, "Q5_0": read_q5_0, "Q5_1": read_q5_1,
           "Q4_K": read_q4_k, "Q5_K": read_q5_k, "Q6_K": read_q6_k}


def _half(a: np.ndarray, up: bool) -> np.ndarray:
    """a rounded up (or down) to values a float16 holds exactly, as float32: pack then stores them in 2 bytes. Kept
    as it was where a float16 would overflow."""
    with np.errstate(over="ignore"):
        near = a.astype(np.float16)
        beyond = near < a if up else near > a
        moved = np.where(beyond, np.nextafter(near, np.float16(np.inf if up else -np.inf)), near).astype(np.float32)
    return np.where(np.isfinite(near) & np.isfinite(moved), moved, a)


def int8_per_channel(weight: np.ndarray) -> Blocks:
    """Weight-only int8 made from float weights [N, K]: one scale per output column (max |w| / 127, rounded up to a
    float16), q rounded to [-127, 127]; u = q + 128. The scale is repeated per block of 32 (the kernel's layout), K a
    multiple of 32."""
    w = weight.astype(np.float32)
    scale = _half(np.abs(w).max(axis=1) / 127, up=True)
    safe = np.where(scale > 0, scale, 1)
    q = np.clip(np.rint(w / safe[:, None]), -127, 127)
    blocks = w.shape[1] // 32
    s = np.repeat(scale[:, None], blocks, axis=1).astype(np.float32)
    return Blocks((q + 128).astype(np.uint8), s, -128 * s, 8, 32)


def int4_groups(weight: np.ndarray) -> Blocks:
    """Weight-only asymmetric 4-bit made from float weights [N, K], as Q4_1: per row and block of 32 inputs, min the
    block's least weight (rounded down to a float16), scale (max - min) / 15 (rounded up to one), u = round((w - min)
    / scale). Round to nearest, no calibration; K a multiple of 32."""
    n, k = weight.shape
    w = weight.astype(np.float32).reshape(n, k // 32, 32)
    low = _half(w.min(axis=2), up=False)
    scale = _half((w.max(axis=2) - low) / 15, up=True)
    safe = np.where(scale > 0, scale, 1)  # a constant block: every u 0, the min alone
    u = np.clip(np.rint((w - low[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    return Blocks(u.reshape(n, k), scale, low, 4, 32)


def exact_in_half(a: np.ndarray) -> bool:
    """Whether every value of a float32 array is a float16 exactly (finite)."""
    with np.errstate(over="ignore"):
        half = a.astype(np.float16)
    return bool(np.isfinite(half).all() and np.array_equal(half.astype(np.float32), a))


def half_scales(blocks: Blocks) -> bool:
    """Whether pack stores these blocks' scales and mins as float16 (lossless: every one is a float16; blocks of 32
    only, pagedq_kernels/cpu_quant.cpp's layouts): Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 store theirs so."""
    return blocks.block == 32 and exact_in_half(blocks.scale) and exact_in_half(blocks.min)


def symmetric(blocks: Blocks, half: bool | None = None) -> bool:
    """Whether pack stores no mins for these blocks: every min is -2^(bits - 1) times its scale (u a signed integer
    stored offset: Q8_0, Q4_0, int8), with float16 scales (half: half_scales(blocks), where the caller has it); the
    kernel puts the offset into its integer sums."""
    half = half_scales(blocks) if half is None else half
    return half and np.array_equal(blocks.min, -(2 ** (blocks.bits - 1)) * blocks.scale)


def gated_order(n: int) -> np.ndarray:
    """The row order that packs a [gate; up] projection of N rows (N / 2 a multiple of 16) for the kernel's gated
    multiply (silu(gate) * up): panel 2p holds gate rows 16p to 16p + 15, panel 2p + 1 the same rows of up."""
    first = np.arange(n // 2).reshape(-1, COLS)
    return np.stack([first, first + n // 2], axis=1).reshape(-1)


def pack(blocks: Blocks) -> np.ndarray:
    """[ceil(N / 16), bytes a panel] uint8 in pagedq_kernels/cpu_quant.cpp's layout; rows past N are zeros. Scales and mins
    are float16 where half_scales, else float32; a symmetric layer's mins are left out."""
    n, k = blocks.u.shape
    panels = -(-n // COLS)
    pad = panels * COLS - n
    u, scale, mins = blocks.u, blocks.scale, blocks.min
    if pad:
        u = np.pad(u, ((0, pad), (0, 0)))
        scale, mins = np.pad(scale, ((0, pad), (0, 0))), np.pad(mins, ((0, pad), (0, 0)))
    nb, quads = k // blocks.block, blocks.block // 4
    # [panel, column, block, quad, 4 inputs] -> [panel, block, quad, column, 4 inputs]: a quad's 64 bytes together
    q = u.reshape(panels, COLS, nb, quads, 4).transpose(0, 2, 3, 1, 4).reshape(panels, nb, quads, 64)
    if blocks.bits == 4:  # quads 2i and 2i + 1 in the low and high nibbles of one register
        q = q[:, :, 0::2] | (q[:, :, 1::2] << 4)
    q = q.reshape(panels, nb, -1)
    half = half_scales(blocks)
    per_block = [a.astype(np.float16 if half else np.float32).reshape(panels, COLS, nb).transpose(0, 2, 1).copy()
                 .view(np.uint8) for a in ((scale,) if symmetric(blocks, half) else (scale, mins))]
    return np.ascontiguousarray(np.concatenate([q, *per_block], axis=2).reshape(panels, -1))
