"""Linear layers whose weights stay quantized in memory, swapped in after a CPU model has loaded its float weights.

The sources (EngineConfig.quantization):
- "auto", a GGUF model: every linear layer whose GGUF tensors are all of block formats pagedq_kernels/quant_layout.py reads
  (READERS) keeps the file's blocks, repacked losslessly; a layer with a tensor of another type keeps the float
  path, and the log says which;
- "auto", an AWQ or GPTQ safetensors checkpoint: its group-wise integers, also losslessly
  (engine.weights.checkpoint); an act-order layer keeps the float path, and the log says which;
- "int8": weight-only int8, one scale per output column, made at load from the float weights of any model;
- "int4": weight-only asymmetric 4-bit per block of 32 inputs (round to nearest), made at load likewise (lm_head
  int8).
Either way the layer multiplies with pagedq_kernels/cpu_quant.cpp (AVX-512 VNNI, else AVX2; activations quantized per row
and block to int8). A fused layer (qkv, gate_up) whose parts differ in format takes the widest of their layouts,
still exactly.
On the triton backend (GPU) the same layers run pagedq_kernels/triton_quant.py's dequantize-matmul instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.weights import gguf_index
from engine.weights.checkpoint import read_checkpoint, scheme
from engine.weights.names import GGUF_PARTS
from engine.weights.packed import PanelLinear, fuses_activation
from pagedq_kernels import quant_layout
from pagedq_kernels.quant_layout import Blocks, stack

log = logging.getLogger("pagedq.engine")


@dataclass
class LayerReport:
    """What one linear layer runs as: its format, the bytes its weights take, and the path."""

    name: str
    format: str  # "Q4_1", "Q8_0", "int8", "Q4_K+Q6_K", "AWQ 4-bit g128", or a float dtype where it is not quantized
    nbytes: int
    path: str  # "avx512_vnni", "avx2" (kernels.cpu_ops.linear_paths), or why it kept the float path


class QuantLinear(PanelLinear):
    """A PanelLinear on quantized panels: the same op (panel_linear hands uint8 weights to the quantized kernel), so
    the C++ decoder stack (pagedq_kernels/cpu_model.cpp) runs it as it runs the float panels."""

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None, ops, fmt: str, gated: bool = False) -> None:
        """gated: blocks are an MLP's [gate; up] rows, packed so that the layer returns silu(gate) * up (bfloat16
        inputs, the AVX-512 kernel; see gates)."""
        nn.Module.__init__(self)
        self.ops = ops
        n = blocks.u.shape[0]
        self.packed = torch.from_numpy(quant_layout.pack(blocks.rows(quant_layout.gated_order(n)) if gated
                                                         else blocks))
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = blocks.u.shape
        self.activates = gated
        self.format = fmt
        self.nbytes = self.packed.numel()


def _unpermute(blocks: Blocks, heads: int) -> Blocks:
    """Undo llama.cpp's conversion of Llama q/k rows (pairs of rotary dims interleaved) to the Hugging Face order, as
    transformers does for the float weights."""
    half = blocks.u.shape[0] // heads // 2
    return blocks.rows(np.arange(blocks.u.shape[0]).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1))


def read_gguf(path: Path, config) -> tuple[dict[str, tuple[Blocks, str]], dict[str, str]]:
    """The GGUF's linear layers under pagedq's module names -> ((blocks, format) where every part has a reader,
    {name: why not} for the rest)."""
    meta, tensors = gguf_index.read(path)
    arch = str(meta.get("general.architecture", ""))
    wanted = {f"model.layers.{i}.{name}": [f"blk.{i}.{p}.weight" for p in parts]
              for i in range(config.num_hidden_layers) for name, parts in GGUF_PARTS.items()}
    wanted["lm_head"] = ["output.weight" if "output.weight" in tensors else "token_embd.weight"]
    found, skipped = {}, {}
    for name, parts in wanted.items():
        types = [tensors[p].type if p in tensors else "missing" for p in parts]
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
        found[name] = (blocks[0] if len(blocks) == 1 else stack(blocks), "+".join(dict.fromkeys(types)))
    return found, skipped


MAKERS = {"int8": quant_layout.int8_per_channel, "int4": quant_layout.int4_groups}
# mode -> (the body's format, lm_head's). 4-bit logits cost most of int4's perplexity (docs/quantization.md, "Perplexity"), so
# int4 keeps lm_head at int8, as llama.cpp's 4-bit files keep output.weight at 6 or 8 bits and AWQ/GPTQ leave it float.
MADE_AT_LOAD = {"int8": ("int8", "int8"), "int4": ("int4", "int8")}


def made_at_load(model: nn.Module, mode: str) -> dict[str, tuple[Blocks, str]]:
    """Weight-only `mode` ("int8" or "int4") of every linear layer with K a multiple of 32, made from its floats."""
    body, head = MADE_AT_LOAD[mode]
    out = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear and module.in_features % 32 == 0:
            fmt = head if name == "lm_head" else body
            out[name] = (MAKERS[fmt](module.weight.detach().float().cpu().numpy()), fmt)
    return out


def sources(model: nn.Module, mode: str, gguf: Path | None, folder: Path | None
            ) -> tuple[dict[str, tuple[Blocks, str]], dict[str, str]]:
    """The model's quantized linear layers for `mode` -> ({module: (Blocks, format)}, {module: why it stays float}).
    The form every consumer of Blocks takes (this CPU swap; a GPU one)."""
    if mode in MADE_AT_LOAD:
        return made_at_load(model, mode), {}
    if gguf is not None:
        found, skipped = read_gguf(gguf, model.config)
        return found, {name: f"GGUF tensor type {kinds} has no quantized kernel" for name, kinds in skipped.items()}
    return read_checkpoint(folder, model.config)


def quantize(model: nn.Module, mode: str, gguf: Path | None, backend, folder: Path | None = None
             ) -> list[LayerReport]:
    """Swap the model's linear layers for QuantLinear where `mode` and the source allow it -> a report per linear
    layer (quantized or not). Does nothing (an empty report) where mode is "none", or "auto" on a float model (no
    GGUF, and `folder` not an AWQ/GPTQ checkpoint). `mode`: one of engine.config.QUANTIZATIONS, checked by the
    EngineConfig it comes from (and by check_mode against the checkpoint)."""
    kept = scheme(model.config)
    if mode == "none" or (mode == "auto" and gguf is None and kept is None):
        if kept is not None:
            log.info("%s checkpoint dequantized to float (quantization none)", kept.name)
        return []
    path = (getattr(backend, "linear_paths", None) or {}).get("quantized")
    if not path:
        why = backend.fallback or ("this CPU has neither AVX-512 VNNI nor AVX2" if backend.name == "cpu"
                                   else f"the {backend.name} backend has no quantized kernel")
        if mode in MADE_AT_LOAD:
            raise ValueError(f"quantization={mode!r} cannot run here: {why}")
        log.warning("%s weights dequantized to float (no quantized kernel here: %s)",
                    "GGUF" if gguf is not None else kept.name, why)
        return []
    found, skipped = sources(model, mode, gguf, folder)
    modules = dict(model.named_modules())
    reports = [_swap(modules, name, blocks, fmt, backend, path) for name, (blocks, fmt) in found.items()]
    for name, why in skipped.items():
        reports.append(_float_report(name, modules[name], why))
        log.info("%s stays float: %s", name, why)
    if kept is not None:  # the layers the checkpoint itself keeps float (lm_head, modules_to_not_convert)
        done = {r.name for r in reports}
        reports += [_float_report(name, m, "not quantized in the checkpoint") for name, m in model.named_modules()
                    if type(m) is nn.Linear and name not in done]
    return reports


def _swap(modules: dict[str, nn.Module], name: str, blocks: Blocks, fmt: str, backend, path: str) -> LayerReport:
    """Put a quantized layer of `blocks` in place of module `name` (modules: the model's, by name; "" the model):
    a QuantLinear for the CPU kernel, a TritonQuantLinear on the triton backend."""
    old = modules[name]
    if path == "triton":  # imported here: a CPU install may have no triton
        from pagedq_kernels.triton_quant import TritonQuantLinear

        new = TritonQuantLinear(blocks, old.bias, fmt, old.weight.device)
    else:
        new = QuantLinear(blocks, old.bias, backend.linears, fmt, gated=gates(name, old, path))
    parent, _, child = name.rpartition(".")
    setattr(modules[parent], child, new)
    log.debug("%s: %s kept quantized, %d bytes, %s", name, fmt, new.nbytes, path)
    return LayerReport(name, fmt, new.nbytes, path)


def gates(name: str, old: nn.Module, path: str) -> bool:
    """Whether the quantized layer in place of `old` returns silu(gate) * up itself, as a bfloat16 PanelLinear's
    does (the same rule), where the AVX-512 kernel runs it."""
    return path == "avx512_vnni" and fuses_activation(name, old)


def _float_report(name: str, module: nn.Module, why: str) -> LayerReport:
    weight = module.weight
    return LayerReport(name, str(weight.dtype).removeprefix("torch."), weight.numel() * weight.element_size(),
                       f"float ({why})")


def check_mode(mode: str, config) -> None:
    """Refuse a mode that makes its own integers from an AWQ/GPTQ checkpoint's (re-quantizing quantized weights),
    before anything loads; a bad quantization_config fails here too."""
    kept = scheme(config)
    if kept is not None and mode in MADE_AT_LOAD:
        raise ValueError(f"quantization={mode!r} quantizes float weights, but this checkpoint is {kept.name} already: "
                         "give quantization 'auto' (run it as stored) or 'none' (dequantized to float)")


def summary(reports: list[LayerReport]) -> str:
    """One line for the start log: layers and bytes per format and path."""
    groups: dict[tuple[str, str], list[int]] = {}
    for r in reports:
        groups.setdefault((r.format, r.path), []).append(r.nbytes)
    return "; ".join(f"{len(b)} layers {fmt} ({sum(b) / 2**20:.1f} MiB, {path})" for (fmt, path), b in groups.items())
