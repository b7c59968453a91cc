"""bfloat16 CPU linear layers with their weights reordered once, at load, into oneDNN's own layout.

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


def _pack(linear: nn.Linear, batch_hint: int) -> PackedLinear:
    w = linear.weight.detach()
    layer = PackedLinear(linear, torch.ops.mkldnn._reorder_linear_weight(w, batch_hint))
    x = torch.randn(3, linear.in_features, dtype=w.dtype)
    if not torch.equal(layer(x), F.linear(x, w, linear.bias)):
        raise ValueError("packed linear disagrees with F.linear")
    return layer


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Swap every bfloat16 nn.Linear of a CPU model for a PackedLinear -> how many were swapped.
    Where this torch build lacks the ops (or they disagree), the model is left as it was."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16
               and child.weight.device.type == "cpu"]
    try:
        packed = [(parent, name, _pack(child, batch_hint)) for parent, name, child in targets]
    except (RuntimeError, AttributeError, ValueError) as e:
        log.warning("linear weights not prepacked (plain F.linear instead): %s", e)
        return 0
    for parent, name, layer in packed:
        setattr(parent, name, layer)
    return len(packed)
