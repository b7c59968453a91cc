"""A kernel backend: the attention ops of one implementation and what else it offers the model.

The engine asks the object, never the module behind it: whether CUDA graphs may capture its ops, whether
paged_attention takes a per-step plan, which fused layers and linear paths it has, and, where "auto" settled for
less than it asked for, why. The contract each op keeps (tensor shapes, dtypes, the KV cache and block table
layouts, how a backend is chosen and falls back) is docs/kernels.md; the Protocols below are its signatures.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pagedq_kernels import torch_ops


class StoreKV(Protocol):
    """k, v [T, Hkv, D] written into k_cache, v_cache [blocks, block_size, Hkv, D] at int64 slots
    (block * block_size + offset); slot -1 writes nothing."""

    def __call__(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, /) -> None: ...


class PagedAttention(Protocol):
    """q [T, Hq, D], the new tokens of B sequences back to back (query_start_loc int32 [B + 1]), attended causally
    to their cached keys through block_table int32 [B, W] (seq_lens int32 [B]: tokens in the cache) -> [T, Hq, D].
    A planned backend's op also takes plan= (Backend.planned)."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, /) -> torch.Tensor: ...


class Argmax(Protocol):
    """Each row's first maximum of [rows, vocab] logits: the greedy tokens."""

    def __call__(self, logits: torch.Tensor, /) -> torch.Tensor: ...


class CopyBlocks(Protocol):
    """kv_cache [2, layers, blocks, ...]: block pairs[0][i] copied into block pairs[1][i] (pairs int64 [2, P]),
    keys and values of every layer."""

    def __call__(self, kv_cache: torch.Tensor, pairs: torch.Tensor, /) -> None: ...


class Layers(Protocol):
    """The elementwise layers in one pass each, in place of the model's torch code (LlamaForCausalLM.use_fast_layers)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> torch.Tensor: ...

    def rotary(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> torch.Tensor: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...


class Linears(Protocol):
    """Linear layers on weights packed once at load (engine.packed_linear.PanelLinear); gated: an MLP's [gate; up]
    rows, the layer returning silu(gate) * up."""

    def panel_pack(self, weight: torch.Tensor, gated: bool) -> torch.Tensor: ...

    def panel_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, gated: bool,
                     out: torch.Tensor | None = None) -> torch.Tensor: ...


class DecoderStack(Protocol):
    """A built decoder stack: a step's flat token batch -> the final norm's output [T, hidden]."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, plan: dict
                 ) -> torch.Tensor: ...


class Decoder(Protocol):
    """The class of a whole Llama-family decoder stack run in one call a step (kernels.cpu_ops.Decoder)."""

    def fits(self, head_dim: int, group: int) -> bool: ...

    def __call__(self, layers: list[dict[str, torch.Tensor | None]], embed: torch.Tensor, norm: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, dims: tuple[int, ...], eps: float, scale: float
                 ) -> DecoderStack: ...


@dataclass(frozen=True)
class Backend:
    name: str  # "torch", "cpu" or "triton"
    store_kv: StoreKV
    paged_attention: PagedAttention
    argmax: Argmax = torch_ops.argmax
    copy_blocks: CopyBlocks = torch_ops.copy_blocks  # KV blocks copied on write, every layer at once
    graph_safe: bool = False  # no host sync, no allocation sized by tensor contents: CUDA graphs may capture it
    planned: bool = False  # paged_attention takes a dict kept for one step (plan=), shared by every layer
    layers: Layers | None = None  # None: the model's torch code
    linears: Linears | None = None
    # For each dtype ("float32", "bfloat16", "quantized") the way this machine multiplies it ("amx", "avx512_bf16",
    # "avx512", "avx512_vnni", "avx_vnni", "avx2", "triton"); a dtype missing here has no such path.
    linear_paths: Mapping[str, str] = field(default_factory=dict)
    decoder: Decoder | None = None  # None: the model runs layer by layer
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
