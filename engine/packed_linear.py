"""bfloat16 CPU linear layers with their weights reordered once, at load: into AMX tiles' layout for our own kernel
where the CPU has AMX (kernels/cpu_linear.cpp, TileLinear), else into oneDNN's (PackedLinear).

TileLinear prefetches the next weights while it multiplies, which a decode step's few rows need (the weights stream
from memory), and an MLP's gate-and-up projection returns silu(gate) * up itself (`activates`), so that wide
projection is never written out. Its sums run in another order than F.linear's: bfloat16 results differ in the last
bit now and then, as they do between any two matmul kernels.

A plain bfloat16 `F.linear` on a CPU with AMX or AVX-512 BF16 has oneDNN reorder the weight on every call: for a
decode step, which reads each weight once, that doubles the memory traffic of the biggest part of the forward.
Packed once, it goes through oneDNN's prepacked linear (an op torch.compile's CPU freezing uses), with results
equal to `F.linear`'s; where the check fails the plain path stays. float32 is left alone: `F.linear` runs it
through MKL, oneDNN's float32 sums in another order (so greedy parity with a float32 reference would go), and
MKL's own packed linear pays off only at the exact batch size it was packed for.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("pagedq.engine")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, packed: torch.Tensor) -> None:
        super().__init__()
        self.packed = packed
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class TileLinear(nn.Module):
    def __init__(self, linear: nn.Linear, ops, gated: bool) -> None:
        super().__init__()
        self.ops = ops
        self.packed = ops.tile_linear_pack(linear.weight, gated)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.out_features = linear.out_features
        self.activates = gated  # the output is silu(gate) * up of the [gate; up] projection (engine.models.llama.MLP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.tile_linear(x, self.packed, self.bias, self.out_features, self.activates)


def _pack(linear: nn.Linear, batch_hint: int) -> PackedLinear:
    w = linear.weight.detach()
    layer = PackedLinear(linear, torch.ops.mkldnn._reorder_linear_weight(w, batch_hint))
    x = torch.randn(3, linear.in_features, dtype=w.dtype)
    if not torch.equal(layer(x), F.linear(x, w, linear.bias)):
        raise ValueError("packed linear disagrees with F.linear")
    return layer


def pack_linears(model: nn.Module, batch_hint: int, ops=None) -> int:
    """Swap every bfloat16 nn.Linear of a CPU model for a TileLinear (where `ops`, kernels.cpu_ops, multiplies on
    AMX tiles and the shape fits) or a PackedLinear -> how many were swapped. An MLP's `gate_up_proj` becomes one
    that activates where its halves fit the tiles (and it has no bias). Where this torch build lacks oneDNN's ops
    (or they disagree), the model is left as it was."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16
               and child.weight.device.type == "cpu"]
    tiles = ops is not None and getattr(ops, "tile_linear_ready", lambda: False)()

    def pack(name: str, linear: nn.Linear) -> nn.Module:
        if not tiles or linear.in_features % 32:
            return _pack(linear, batch_hint)
        halves_fit = (linear.out_features // 2) % 16 == 0 and linear.bias is None
        return TileLinear(linear, ops, gated=name == "gate_up_proj" and halves_fit)

    try:
        packed = [(parent, name, pack(name, child)) for parent, name, child in targets]
    except (RuntimeError, AttributeError, ValueError) as e:
        log.warning("linear weights not prepacked (plain F.linear instead): %s", e)
        return 0
    for parent, name, layer in packed:
        setattr(parent, name, layer)
    return len(packed)
