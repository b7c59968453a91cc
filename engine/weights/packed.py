"""CPU linear layers with their weights reordered once, at load: into panels for pagedq's own kernel where the CPU
has a path for the dtype (pagedq_kernels/cpu_linear.cpp: AMX tiles or AVX-512 BF16 dot products for bfloat16, AVX-512
multiply-adds for float32; PanelLinear), else into oneDNN's layout (PackedLinear).

A decode step reads every weight once for a few rows, so the weights streaming from memory set its pace: the
panels are read in order, each once per block of rows, and an MLP's gate-and-up projection returns silu(gate) * up
itself in bfloat16 (`activates`), so that wide projection is never written out. The kernel sums in input order, in
float32: results differ from F.linear's (MKL's or oneDNN's order) in the last bits now and then, as they do between
any two matmul kernels. Measured on a 2-core EPYC (Zen 4, no AMX): float32 F.linear goes through MKL, which streams
weights at half the rate of the panels at one row and is slower at every batch size (docs/benchmarks.md).

A plain bfloat16 `F.linear` on a CPU with AMX or AVX-512 BF16 has oneDNN reorder the weight on every call; packed
once, it goes through oneDNN's prepacked linear (an op torch.compile's CPU freezing uses), with results equal to
`F.linear`'s. That is the path where the panels do not fit (K not a multiple of 32) or have no path on this CPU.
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


class PanelLinear(nn.Module):
    def __init__(self, linear: nn.Linear, ops, gated: bool) -> None:
        super().__init__()
        self.ops = ops
        self.packed = ops.panel_pack(linear.weight, gated)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.out_features = linear.out_features
        self.activates = gated  # the output is silu(gate) * up of the [gate; up] projection (engine.models.llama.MLP)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: a contiguous [rows, N] buffer to write into (the logits of a step: reused, not allocated anew)."""
        return self.ops.panel_linear(x, self.packed, self.bias, self.out_features, self.activates, out)


def fuses_activation(name: str, linear: nn.Linear) -> bool:
    """Whether `linear` (module `name`) is an MLP's [gate; up] projection that a panel kernel returns silu(gate) * up
    of: bfloat16, no bias, each half whole panels of 16 columns."""
    halves_fit = (linear.out_features // 2) % 16 == 0 and linear.bias is None
    return name.rpartition(".")[2] == "gate_up_proj" and halves_fit and linear.weight.dtype == torch.bfloat16


def _onednn(linear: nn.Linear, batch_hint: int) -> PackedLinear:
    w = linear.weight.detach()
    layer = PackedLinear(linear, torch.ops.mkldnn._reorder_linear_weight(w, batch_hint))
    x = torch.randn(3, linear.in_features, dtype=w.dtype)
    got, want = layer(x), F.linear(x, w, linear.bias)
    # bfloat16: the same kernel as F.linear's, so the same numbers; float32: oneDNN against MKL, another order.
    same = torch.equal(got, want) if w.dtype == torch.bfloat16 else torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    if not same:
        raise ValueError("packed linear disagrees with F.linear")
    return layer


def pack_linears(model: nn.Module, batch_hint: int, backend=None) -> int:
    """Swap every bfloat16 and float32 nn.Linear of a CPU model for a PanelLinear (where `backend`, a
    kernels.Backend, has a panel path for its dtype and K is a multiple of 32) or a PackedLinear (oneDNN) -> how many
    were swapped. A bfloat16 MLP's `gate_up_proj` becomes one that activates where its halves fit a panel (and it
    has no bias). Where this torch build lacks oneDNN's ops (or they disagree), those layers are left as they were."""
    paths = getattr(backend, "linear_paths", {}) or {}
    names = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.dtype in names and child.weight.device.type == "cpu"]

    def pack(name: str, linear: nn.Linear) -> nn.Module:
        if names[linear.weight.dtype] not in paths or linear.in_features % 32:
            return _onednn(linear, batch_hint)
        return PanelLinear(linear, backend.linears, fuses_activation(name, linear))

    swapped = 0
    for parent, name, child in targets:
        try:
            setattr(parent, name, pack(name, child))
            swapped += 1
        except (RuntimeError, AttributeError, ValueError) as e:
            log.warning("%s weights not prepacked (plain F.linear instead): %s", name, e)
    return swapped
