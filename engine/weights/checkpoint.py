"""AWQ and GPTQ safetensors checkpoints: their quantization_config checked, their linear layers read.

A checkpoint's config.json names the method in `quantization_config` (transformers keeps it on the config). The
float skeleton (engine.models.llama) loads every other tensor as usual, and each quantized linear layer dequantized
to float (`dequantized`): exact, and what runs where there is no quantized kernel (the torch backend, CPUs without
AVX-512 VNNI, CUDA for now, tensor parallelism). On a CPU with the kernel, engine.weights.quantized swaps those layers
for the checkpoint's own integers (`read_checkpoint`, in the form read_gguf gives: {module: (Blocks, format)}).

What a vLLM user would expect, and why: a config pagedq cannot read right (AWQ of other than 4 bits or another
version than "gemm", GPTQ of 2 or 3 bits, a serialized kernel format such as "marlin", another quant_method) is an
error naming the field, since no float fallback could give the right weights without reading that layout. A layer
whose groups do not fall on blocks of 32 inputs (act-order GPTQ, a group size not a multiple of 32) is read exactly
all the same, so it runs dequantized to float and the log and `pagedq models layers` say so.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.weights.awq_gptq import Groups, read_awq, read_gptq
from engine.weights.names import FUSED, part_count
from pagedq_kernels.quant_layout import Blocks, stack


@dataclass(frozen=True)
class Scheme:
    method: str  # "awq" or "gptq"
    bits: int
    group: int  # -1: one group of all inputs
    desc_act: bool = False
    v1: bool = False  # GPTQ zeros stored minus one

    @property
    def name(self) -> str:
        """The format as reports show it: "AWQ 4-bit g128", "GPTQ 4-bit per-channel"."""
        group = "per-channel" if self.group == -1 else f"g{self.group}"
        return f"{self.method.upper()} {self.bits}-bit {group}" + (" act-order" if self.desc_act else "")


def _field(qc: dict, *keys: str, default=None):
    for key in keys:
        if key in qc:
            return qc[key]
    if default is None:
        raise ValueError(f"quantization_config has no {keys[0]!r}")
    return default


def scheme(config) -> Scheme | None:
    """The checkpoint's quantization scheme from config.quantization_config, checked; None for a float checkpoint."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported: pagedq reads 'awq' and "
                         "'gptq' safetensors checkpoints, GGUF files and float checkpoints")
    bits = int(_field(qc, "bits", "w_bit"))
    group = int(_field(qc, "group_size", "q_group_size"))
    if group != -1 and group < 1:
        raise ValueError(f"quantization_config.group_size must be -1 or positive, got {group}")
    if method == "awq":
        if bits != 4:
            raise ValueError(f"quantization_config.bits {bits}: AWQ checkpoints are 4-bit (as vLLM requires)")
        version = str(_field(qc, "version", default="gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version {version!r}: pagedq reads AWQ's 'gemm' layout only")
        if not _field(qc, "zero_point", default=True):
            raise ValueError("quantization_config.zero_point false: pagedq reads AWQ with zero points only")
        return Scheme("awq", 4, group)
    if bits not in (4, 8):
        raise ValueError(f"quantization_config.bits {bits}: pagedq reads GPTQ of 4 or 8 bits")
    fmt = str(qc.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format {fmt!r}: pagedq reads 'gptq' and 'gptq_v2'")
    return Scheme("gptq", bits, group, bool(qc.get("desc_act", False)), fmt == "gptq")


def _read(f, keys: set[str], prefix: str, s: Scheme) -> Groups:
    """One layer's Groups from an open safetensors file holding `keys`."""

    def get(suffix: str) -> np.ndarray | None:
        name = f"{prefix}.{suffix}"
        if name not in keys:
            return None
        t = f.get_tensor(name)
        return (t.float() if t.is_floating_point() else t).numpy()

    qweight, qzeros, scales = get("qweight"), get("qzeros"), get("scales")
    for suffix, t in (("qzeros", qzeros), ("scales", scales)):
        if t is None:
            raise ValueError(f"{prefix}.{suffix} is missing from the {s.name} checkpoint")
    if s.method == "awq":
        return read_awq(qweight, qzeros, scales, s.group, prefix)
    return read_gptq(qweight, qzeros, scales, get("g_idx"), s.bits, s.group, s.v1, prefix)


def layers(folder: Path, s: Scheme) -> Iterator[tuple[str, Groups]]:
    """(checkpoint name, e.g. model.layers.0.self_attn.q_proj, Groups) of every quantized linear layer of the
    checkpoint, one at a time."""
    from safetensors import safe_open

    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            for prefix in sorted(k.removesuffix(".qweight") for k in keys if k.endswith(".qweight")):
                yield prefix, _read(f, keys, prefix, s)


def dequantized(folder: Path, s: Scheme) -> Iterator[tuple[str, torch.Tensor]]:
    """(name of the float weight, e.g. ...q_proj.weight, [N, K] float32) of every quantized linear layer."""
    for prefix, groups in layers(folder, s):
        yield f"{prefix}.weight", torch.from_numpy(groups.dequantize())


def why_float(s: Scheme) -> str:
    """Why a layer of this scheme has no Blocks (Groups.blocks() gave None)."""
    if s.desc_act:
        return f"{s.name}: act-order groups do not fall on blocks of 32 inputs, dequantized to float"
    return f"{s.name}: groups do not fall on blocks of 32 inputs, dequantized to float"


def read_checkpoint(folder: Path, config) -> tuple[dict[str, tuple[Blocks, str]], dict[str, str]]:
    """The checkpoint's quantized linear layers under pagedq's module names (q/k/v and gate/up stacked) ->
    ({module: (Blocks, format)} where every part maps onto blocks of 32, {module: why float} for the rest)."""
    s = scheme(config)
    parts: dict[str, dict[int, Blocks | None]] = {}
    for prefix, groups in layers(folder, s):
        module, _, leaf = prefix.rpartition(".")
        fused, index = FUSED.get(leaf, (leaf, 0))
        parts.setdefault(f"{module}.{fused}" if module else fused, {})[index] = groups.blocks()
    found, skipped = {}, {}
    for name, by_index in parts.items():
        want = part_count(name.rpartition(".")[2])
        blocks = [by_index.get(i) for i in range(want)]
        if len(by_index) != want:  # e.g. modules_to_not_convert names q_proj alone: one stacked layer, one layout
            skipped[name] = f"{s.name}: only some of its parts are quantized in the checkpoint, dequantized to float"
        elif any(b is None for b in blocks):
            skipped[name] = why_float(s)
        else:
            found[name] = (blocks[0] if want == 1 else stack(blocks), s.name)
    return found, skipped
