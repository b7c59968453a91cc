"""A kernel backend: the attention ops of one implementation and what else it offers the model.

The engine asks the object, never the module behind it: whether CUDA graphs may capture its ops, whether
paged_attention takes a per-step plan, which fused layers and linear paths it has, and, where "auto" settled for
less than it asked for, why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import torch_ops


@dataclass(frozen=True)
class Backend:
    name: str  # "torch", "cpu" or "triton"
    # store_kv(k, v, k_cache, v_cache, slot_mapping); paged_attention(q, k_cache, v_cache, query_start_loc,
    # seq_lens, block_table, scale[, plan]): the kernel contract of DESIGN.md.
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    argmax: Callable[[torch.Tensor], torch.Tensor] = torch_ops.argmax  # each row's first maximum (greedy tokens)
    # copy_blocks(kv_cache, pairs): KV blocks copied on write, every layer at once (kernels.torch_ops.copy_blocks)
    copy_blocks: Callable[[torch.Tensor, torch.Tensor], None] = torch_ops.copy_blocks
    graph_safe: bool = False  # no host sync, no allocation sized by tensor contents: CUDA graphs may capture it
    planned: bool = False  # paged_attention takes a dict kept for one step (plan=), shared by every layer
    # rms_norm, add_rms_norm, rotary and silu_and_mul in one pass each (LlamaForCausalLM.use_fast_layers); None: the
    # model's torch code.
    layers: Any = None
    # panel_pack / panel_linear / panel_linear_out (engine.weights.packed.PanelLinear), and for each dtype the way
    # this CPU multiplies them ("amx", "avx512_bf16", "avx512"); a dtype missing from linear_paths has none.
    linears: Any = None
    linear_paths: Mapping[str, str] = field(default_factory=dict)
    # A class that runs a whole Llama-family decoder stack in one call a step on these kernels (kernels.cpu_ops.Decoder:
    # fits(head_dim, group), then Decoder(...)(...)); None: the model runs layer by layer.
    decoder: Any = None
    fallback: str | None = None  # why "auto" runs the torch ops here, where it would have run more

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, plan: dict) -> torch.Tensor:
        """paged_attention, handing it the step's plan where it takes one."""
        if self.planned:
            return self.paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, plan=plan)
        return self.paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale)

    def describe(self) -> str:
        """One line for the start log: the backend and its CPU paths."""
        parts = [self.name]
        if self.linear_paths:
            parts.append("linears " + ", ".join(f"{d}: {p}" for d, p in self.linear_paths.items()))
        if self.fallback:
            parts.append(f"(torch ops: {self.fallback})")
        return "; ".join(parts)


TORCH = Backend("torch", torch_ops.store_kv, torch_ops.paged_attention)
