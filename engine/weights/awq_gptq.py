"""Group-wise quantized safetensors checkpoints (AWQ, GPTQ) read into pagedq_kernels/quant_layout.Blocks.

Who owns what: a checkpoint's tensor formats and layer names are engine/weights' (this module reads AWQ's and
GPTQ's packed integers, checkpoint.py their config and layers, names.py the layer maps); the block layout the
kernels multiply is pagedq_kernels/quant_layout's, and this module only fills its Blocks. So nothing here is in pagedq_kernels/,
which would otherwise hold a checkpoint format it never runs.

Both formats store a linear layer of K inputs and N outputs as integers q of `bits` bits with, per group of inputs
and output column, a float16 scale s and an integer zero z: weight[n, k] = s[g, n] * (q[k, n] - z[g, n]), g the
group of input k. Integers are packed 32 // bits to an int32, the first in the lowest bits.

  AWQ (AutoAWQ "gemm", 4-bit): qweight [K, N / 8], packed along N; within an int32 the 8 columns of its span sit in
      the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column AWQ_ORDER[i]). qzeros [K / group, N / 8], packed the
      same way. scales [K / group, N]. Input k is in group k // group.
  GPTQ (AutoGPTQ / GPTQModel, 4- or 8-bit): qweight [K / pack, N], packed along K in order (int32 r holds inputs
      pack r .. pack r + pack - 1). qzeros [groups, N / pack], packed along N in order. scales [groups, N]. g_idx [K]:
      the group of each input; with desc_act (act-order) it need not be k // group. checkpoint_format "gptq" (v1,
      the default) stores z - 1 (the writer's quirk; readers add the 1 back), "gptq_v2" stores z.
  group_size -1: one group over all K inputs (per output column).

Either maps onto Blocks without rounding where every aligned run of 32 inputs lies in one group: u = q, scale = s,
min = -s * z (a float16 times an integer up to 256: exact in float32), the group's scale repeated per block of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedq_kernels.quant_layout import Blocks

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of an AWQ int32 holds
BLOCK = 32  # inputs a block of the quantized kernel's 4- and 8-bit layouts


@dataclass
class Groups:
    """One linear layer as its checkpoint groups it: weight[n, k] = scale[n, g] * (q[n, k] - zero[n, g]), g = g_idx[k]."""

    q: np.ndarray  # [N, K] uint8
    scale: np.ndarray  # [N, groups] float32
    zero: np.ndarray  # [N, groups] float32
    g_idx: np.ndarray  # [K] int64
    bits: int

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, exactly the weights."""
        return self.scale[:, self.g_idx] * (self.q.astype(np.float32) - self.zero[:, self.g_idx])

    def blocks(self) -> Blocks | None:
        """These weights as Blocks of 32 inputs, or None where a block's inputs span groups (act-order, or a group
        size that is not a multiple of 32): the kernel has one scale a block."""
        k = self.q.shape[1]
        if k % BLOCK:
            return None
        runs = self.g_idx.reshape(-1, BLOCK)
        if (runs != runs[:, :1]).any():
            return None
        g = runs[:, 0]
        scale = np.ascontiguousarray(self.scale[:, g])
        return Blocks(self.q, scale, -scale * self.zero[:, g], self.bits, BLOCK)


def unpack(packed: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> their 32 // bits integers each, in order (lowest bits first), along `axis` (0 or 1), as uint8."""
    words = packed.astype(np.int32).view(np.uint32)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    if axis == 0:
        values = (words[:, None, :] >> shifts[None, :, None]) & (2**bits - 1)
        return values.reshape(-1, words.shape[1]).astype(np.uint8)
    values = (words[:, :, None] >> shifts) & (2**bits - 1)
    return values.reshape(words.shape[0], -1).astype(np.uint8)


def _check(name: str, array: np.ndarray, shape: tuple[int, ...]) -> None:
    if array.shape != shape:
        raise ValueError(f"{name} has shape {list(array.shape)}, expected {list(shape)}")


def read_awq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group: int, name: str = "") -> Groups:
    """An AWQ (gemm, 4-bit) layer; group -1: one group of all inputs. name: the layer, for errors."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = k if group == -1 else group
    if k % group:
        raise ValueError(f"{name}: {k} inputs are not whole groups of group_size {group}")
    _check(f"{name}.qzeros", qzeros, (k // group, n // 8))
    _check(f"{name}.scales", scales, (k // group, n))
    reorder = np.argsort(AWQ_ORDER)  # column j of a word is nibble reorder[j]

    def columns(packed: np.ndarray) -> np.ndarray:
        return unpack(packed, 4, 1).reshape(packed.shape[0], -1, 8)[..., reorder].reshape(packed.shape[0], -1)

    return Groups(np.ascontiguousarray(columns(qweight).T), scales.astype(np.float32).T.copy(),
                  columns(qzeros).astype(np.float32).T.copy(), np.arange(k) // group, 4)


def read_gptq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None, bits: int,
              group: int, v1: bool, name: str = "") -> Groups:
    """A GPTQ layer of 4 or 8 bits; g_idx None: k // group (checkpoints without act-order may omit it); v1: zeros
    stored minus one (checkpoint_format "gptq")."""
    if bits not in (4, 8):
        raise ValueError(f"{name}: GPTQ bits must be 4 or 8 here, got {bits}")
    pack = 32 // bits
    k, n = qweight.shape[0] * pack, qweight.shape[1]
    groups = scales.shape[0]
    _check(f"{name}.scales", scales, (groups, n))
    _check(f"{name}.qzeros", qzeros, (groups, n // pack))
    if g_idx is None:
        size = k if group == -1 else group
        if k % size or k // size != groups:
            raise ValueError(f"{name}: {groups} groups of scales do not cover {k} inputs in groups of {size}")
        g_idx = np.arange(k) // size
    _check(f"{name}.g_idx", g_idx, (k,))
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise ValueError(f"{name}.g_idx holds groups outside [0, {groups})")
    zero = unpack(qzeros, bits, 1).astype(np.float32) + (1 if v1 else 0)
    return Groups(np.ascontiguousarray(unpack(qweight, bits, 0).T), scales.astype(np.float32).T.copy(),
                  zero.T.copy(), g_idx.astype(np.int64), bits)
