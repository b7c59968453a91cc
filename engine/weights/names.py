"""The checkpoint layer maps: which of pagedq's layers each checkpoint tensor fills. The model, the AWQ/GPTQ reader
and the GGUF reader all name layers through these, so a new layout or family changes this one file."""

from __future__ import annotations

# Hugging Face layer -> (pagedq's fused layer, its part): q/k/v rows stack into qkv_proj, gate/up into gate_up_proj.
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

# pagedq's linear layers -> the GGUF tensors whose rows they stack, in order (blk.{i}.<part>.weight)
GGUF_PARTS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
              "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}

# An AWQ/GPTQ linear's tensors, in place of its weight
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def fused(name: str) -> tuple[str, int | None]:
    """A checkpoint tensor's name -> (pagedq's parameter, its part; None where it is not stacked):
    model.layers.0.self_attn.k_proj.weight -> (model.layers.0.self_attn.qkv_proj.weight, 1)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in FUSED:
            parts[i], index = FUSED[part]
            return ".".join(parts), index
    return name, None


def part_count(layer: str) -> int:
    """How many checkpoint layers stack into pagedq's `layer` (a leaf name: qkv_proj 3, gate_up_proj 2, else 1)."""
    return sum(target == layer for target, _ in FUSED.values()) or 1
