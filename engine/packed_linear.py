"""CPU linear layers with their weights reordered once, at load, into the layout the matmul library computes in.

A plain bfloat16 `F.linear` on a CPU with AMX or AVX-512 BF16 has oneDNN reorder the weight on every call: for a
decode step, which reads each weight once, that doubles the memory traffic of the biggest part of the forward.
Packed once, bfloat16 goes through oneDNN's prepacked linear and float32 through MKL's (the ops torch.compile's
CPU freezing uses). Both give the same numbers as `F.linear`; a layer whose check fails keeps the plain path.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("pagedq.engine")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, packed: torch.Tensor, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = packed
        self.bias = linear.bias
        self.batch_hint = batch_hint
        self.mkl_weight = linear.weight if linear.weight.dtype == torch.float32 else None  # MKL's op wants both

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mkl_weight is not None:
            return torch.ops.mkl._mkl_linear(x, self.packed, self.mkl_weight, self.bias, self.batch_hint)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _pack(linear: nn.Linear, batch_hint: int) -> PackedLinear:
    w = linear.weight.detach()
    if w.dtype == torch.bfloat16:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
    else:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, batch_hint)
    layer = PackedLinear(linear, packed, batch_hint)
    x = torch.randn(3, linear.in_features, dtype=w.dtype)
    if not torch.equal(layer(x), F.linear(x, w, linear.bias)):
        raise ValueError("packed linear disagrees with F.linear")
    return layer


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Swap every bfloat16 / float32 nn.Linear of a CPU model for a PackedLinear -> how many were swapped.
    Where this torch build lacks the ops (or they disagree), the model is left as it was."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.dtype in (torch.bfloat16, torch.float32)
               and child.weight.device.type == "cpu"]
    try:
        packed = [(parent, name, _pack(child, batch_hint)) for parent, name, child in targets]
    except (RuntimeError, AttributeError, ValueError) as e:
        log.warning("linear weights not prepacked (plain F.linear instead): %s", e)
        return 0
    for parent, name, layer in packed:
        setattr(parent, name, layer)
    return len(packed)
