"""Linear layers whose weights stay quantized in memory, swapped in after a CPU model has loaded its float weights.

Two sources (EngineConfig.quantization):
- "auto", a GGUF model: every linear layer whose GGUF tensors are Q8_0, Q4_0, Q4_1, Q4_K or Q6_K keeps the file's
  blocks (repacked losslessly, kernels/quant_layout.py); a layer with a tensor of another type keeps the float path,
  and the log says which;
- "int8": weight-only int8, one scale per output column, made at load from the float weights of any model.
Either way the layer multiplies with kernels/cpu_quant.cpp (AVX-512 VNNI, else AVX2; activations quantized per row
and block to int8). A fused layer (qkv, gate_up) whose parts differ in format takes the widest of their layouts, still exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.packed_linear import PanelLinear
from kernels import quant_layout
from kernels.quant_layout import Blocks

log = logging.getLogger("pagedq.engine")

# pagedq's fused linears -> the GGUF tensors whose rows they stack, in order ({i}: the layer)
GGUF_PARTS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
              "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


@dataclass
class LayerReport:
    """What one linear layer runs as: its format, the bytes its weights take, and the path."""

    name: str
    format: str  # "Q4_1", "Q8_0", "int8", "Q4_K+Q6_K", or a float dtype where it was not quantized
    nbytes: int
    path: str  # "avx512_vnni", "avx2" (kernels.cpu_ops.linear_paths), or why it kept the float path


class QuantLinear(PanelLinear):
    """A PanelLinear on quantized panels: the same op (panel_linear hands uint8 weights to the quantized kernel), so
    the C++ decoder stack (kernels/cpu_model.cpp) runs it as it runs the float panels."""

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None, ops, fmt: str) -> None:
        nn.Module.__init__(self)
        self.ops = ops
        self.packed = torch.from_numpy(quant_layout.pack(blocks))
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = blocks.u.shape
        self.activates = False
        self.format = fmt


def common(parts: list[Blocks]) -> Blocks:
    """Row-stacked blocks in the widest layout of the parts (4 bits fit in 8; a block of 32 is two of 16)."""
    bits, block = max(p.bits for p in parts), min(p.block for p in parts)

    def widen(p: Blocks) -> Blocks:
        repeat = p.block // block
        return Blocks(p.u, np.repeat(p.scale, repeat, 1), np.repeat(p.min, repeat, 1), bits, block)

    wide = [widen(p) for p in parts]
    return Blocks(np.concatenate([p.u for p in wide]), np.concatenate([p.scale for p in wide]),
                  np.concatenate([p.min for p in wide]), bits, block)


def _unpermute(blocks: Blocks, heads: int) -> Blocks:
    """Undo llama.cpp's conversion of Llama q/k rows (pairs of rotary dims interleaved) to the Hugging Face order, as
    transformers does for the float weights."""
    half = blocks.u.shape[0] // heads // 2
    return blocks.rows(np.arange(blocks.u.shape[0]).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1))


def read_gguf(path: Path, config) -> tuple[dict[str, tuple[Blocks, str]], dict[str, str]]:
    """The GGUF's linear layers under pagedq's module names -> ((blocks, format) where every part has a reader,
    {name: why not} for the rest)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents()) if "general.architecture" in reader.fields else ""
    tensors = {t.name: t for t in reader.tensors}
    wanted = {f"model.layers.{i}.{name}": [f"blk.{i}.{p}.weight" for p in parts]
              for i in range(config.num_hidden_layers) for name, parts in GGUF_PARTS.items()}
    wanted["lm_head"] = ["output.weight" if "output.weight" in tensors else "token_embd.weight"]
    found, skipped = {}, {}
    for name, parts in wanted.items():
        types = [tensors[p].tensor_type.name if p in tensors else "missing" for p in parts]
        if any(t not in quant_layout.READERS for t in types):
            skipped[name] = "+".join(sorted(set(types)))
            continue
        blocks = []
        for part, kind in zip(parts, types, strict=True):
            b = quant_layout.READERS[kind](np.asarray(tensors[part].data))
            if arch == "llama" and ".attn_q." in part:
                b = _unpermute(b, config.num_attention_heads)
            elif arch == "llama" and ".attn_k." in part:
                b = _unpermute(b, config.num_key_value_heads)
            blocks.append(b)
        found[name] = (blocks[0] if len(blocks) == 1 else common(blocks), "+".join(dict.fromkeys(types)))
    return found, skipped


def int8_blocks(model: nn.Module) -> dict[str, tuple[Blocks, str]]:
    """Weight-only per-output-channel int8 of every linear layer with K a multiple of 32."""
    out = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear and module.in_features % 32 == 0:
            out[name] = (quant_layout.int8_per_channel(module.weight.detach().float().numpy()), "int8")
    return out


def quantize(model: nn.Module, mode: str, gguf: Path | None, backend) -> list[LayerReport]:
    """Swap the model's linear layers for QuantLinear where `mode` and the source allow it -> a report per linear
    layer (quantized or not). Does nothing (an empty report) where mode is "none", or "auto" without a GGUF. `mode`:
    one of engine.config.QUANTIZATIONS, checked by the EngineConfig it comes from."""
    if mode == "none" or (mode == "auto" and gguf is None):
        return []
    path = (getattr(backend, "linear_paths", None) or {}).get("quantized")
    if not path:
        why = backend.fallback or ("this CPU has neither AVX-512 VNNI nor AVX2" if backend.name == "cpu"
                                   else f"the {backend.name} backend has no quantized kernel")
        if mode == "int8":
            raise ValueError(f"quantization='int8' cannot run here: {why}")
        log.warning("GGUF weights dequantized to float (no quantized kernel here: %s)", why)
        return []
    found, skipped = read_gguf(gguf, model.config) if mode == "auto" else (int8_blocks(model), {})
    modules = dict(model.named_modules())
    reports = []
    for name, (blocks, fmt) in found.items():
        old = modules[name]
        new = QuantLinear(blocks, old.bias, backend.linears, fmt)
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, new)
        reports.append(LayerReport(name, fmt, new.packed.numel(), path))
        log.debug("%s: %s kept quantized, %d bytes, %s", name, fmt, new.packed.numel(), path)
    for name, kinds in skipped.items():
        weight = modules[name].weight
        reports.append(LayerReport(name, str(weight.dtype).removeprefix("torch."), weight.numel() * weight.element_size(),
                                   f"float (GGUF tensor type {kinds} has no quantized kernel)"))
        log.info("%s stays float: its GGUF tensors are %s, which pagedq does not run quantized", name, kinds)
    return reports


def summary(reports: list[LayerReport]) -> str:
    """One line for the start log: layers and bytes per format and path."""
    groups: dict[tuple[str, str], list[int]] = {}
    for r in reports:
        groups.setdefault((r.format, r.path), []).append(r.nbytes)
    return "; ".join(f"{len(b)} layers {fmt} ({sum(b) / 2**20:.1f} MiB, {path})" for (fmt, path), b in groups.items())
