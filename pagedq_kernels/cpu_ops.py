"""The CPU path in C++: decode and prefill attention that read the KV blocks in place (pagedq_kernels/cpu_attention.cpp,
pagedq_kernels/cpu_prefill.cpp, which needs AVX-512), where the torch path gathers each sequence's blocks into a copy and
attends over it; RMSNorm, rotary and (bfloat16) SiLU-and-multiply as one pass each (pagedq_kernels/cpu_layers.cpp); keys
and values stored with a copy per token; linear layers of our own on packed weight panels (pagedq_kernels/cpu_linear.cpp,
used by engine.weights.packed). pagedq_kernels/build.py compiles them; `load` makes them torch.ops.pagedq.* here.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedq_kernels import build, torch_ops

_lock = threading.Lock()
_state: dict[str, str | None] = {}  # build root -> None when loaded, else why the kernels are not available


def load(root: Path) -> str | None:
    """Build (once per environment, see pagedq_kernels/build.py) and load the kernels: None once they are usable, else why
    not (no compiler, a failed build, another process's build that never finished)."""
    with _lock:
        if str(root) not in _state:
            _state[str(root)] = _load(root)
        return _state[str(root)]


def _load(root: Path) -> str | None:
    if hasattr(torch.ops.pagedq, "decode_attention"):  # this process registered them already (another root)
        return None
    try:
        lib, built_now = build.ensure_built(root)
    except build.BuildError as e:
        return str(e)
    if not built_now:  # a build loads what it built
        torch.ops.load_library(str(lib))
    return None


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """pagedq_kernels.torch_ops.store_kv's contract: one copy per token in C++ where the dtypes and layout allow it."""
    if slot_mapping.numel() == 0:
        return
    if k.dtype != k_cache.dtype or not (_heads_contiguous(k) and _heads_contiguous(v)):
        torch_ops.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    torch.ops.pagedq.store_kv(k, v, k_cache, v_cache, slot_mapping.to(torch.int64).contiguous())


def copy_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """pagedq_kernels.torch_ops.copy_blocks's contract: a memcpy per block, layer and keys or values, spread over threads."""
    if pairs.shape[1]:
        torch.ops.pagedq.copy_blocks(kv_cache, pairs.contiguous())


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


@functools.cache
def head_sizes() -> frozenset[int]:
    """The head sizes the kernel is built for; others decode in torch."""
    return frozenset(torch.ops.pagedq.head_sizes())


@functools.cache
def _prefill_max_group() -> int:
    """The most query heads per KV head the prefill kernel takes; 0 where it is not built (no AVX-512)."""
    return int(torch.ops.pagedq.prefill_max_group())


def _prefill_built(head_dim: int, group: int) -> bool:
    return head_dim in head_sizes() and group <= _prefill_max_group()


@dataclass
class _Plan:
    """What paged_attention derives from a step's batch, the same for every layer: which sequences decode and which
    prefill, and the index tensors in the kernels' dtypes."""

    starts: list[int]
    lens: list[int]
    q_lens: list[int]
    decoding: list[int]
    prefilling: list[int]
    query_start_loc: torch.Tensor  # int64
    seq_lens: torch.Tensor  # int32
    block_table: torch.Tensor  # int32
    decode_seqs: torch.Tensor
    decode_rows: torch.Tensor
    prefill_seqs: torch.Tensor

    @classmethod
    def of(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor) -> _Plan:
        starts, lens, q_lens = torch_ops.split(query_start_loc, seq_lens)
        decoding = [b for b, n in enumerate(q_lens) if n == 1]
        prefilling = [b for b, n in enumerate(q_lens) if n > 1]
        query_start_loc = query_start_loc.to(torch.int64).contiguous()
        decode_seqs = torch.tensor(decoding, dtype=torch.int64)
        return cls(starts, lens, q_lens, decoding, prefilling, query_start_loc, seq_lens.to(torch.int32).contiguous(),
                   block_table.to(torch.int32).contiguous(), decode_seqs, query_start_loc.index_select(0, decode_seqs),
                   torch.tensor(prefilling, dtype=torch.int64))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    plan: dict | None = None,
) -> torch.Tensor:
    """pagedq_kernels.torch_ops.paged_attention's contract in C++: one-token queries to the decode kernel, longer ones
    (prompts, chunks) to the prefill kernel; head shapes neither is built for go to the torch ops. plan: a dict kept
    for the step (AttnContext.plan), where what every layer would derive alike is derived once."""
    cached = plan.get(__name__) if plan is not None else None
    p = cached or _Plan.of(query_start_loc, seq_lens, block_table)
    if plan is not None:
        plan[__name__] = p
    out = torch.empty_like(q)
    if p.decoding and q.shape[2] not in head_sizes():
        torch_ops.decode(q, k_cache, v_cache, p.decoding, p.starts, p.lens, block_table, scale, out)
    elif p.decoding:
        torch.ops.pagedq.decode_attention(q.contiguous(), k_cache, v_cache, p.decode_rows, p.decode_seqs, p.seq_lens,
                                          p.block_table, scale, out)
    if p.prefilling and not _prefill_built(q.shape[2], q.shape[1] // k_cache.shape[2]):
        torch_ops.prefill(q, k_cache, v_cache, p.starts, p.lens, p.q_lens, block_table, scale, out)
    elif p.prefilling:
        torch.ops.pagedq.prefill_attention(q.contiguous(), k_cache, v_cache, p.prefill_seqs, p.query_start_loc,
                                           p.seq_lens, p.block_table, scale, out)
    return out


# The elementwise layers (pagedq_kernels/cpu_layers.cpp), for LlamaForCausalLM.use_fast_layers.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension; x of any shape (rows of weight's size)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=x.dtype)
    torch.ops.pagedq.rms_norm(rows, weight, eps, out)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(residual + x), with residual += x in place (the sum rounded as torch rounds it)."""
    rows, stream = x.reshape(-1, x.shape[-1]), residual.view(-1, residual.shape[-1])
    out = torch.empty(rows.shape, dtype=x.dtype)
    torch.ops.pagedq.add_rms_norm(rows, stream, weight, eps, out)
    return out.view(x.shape)


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated in place (rotate-half layout) at int64 positions [T] by float32 tables [P, D]."""
    torch.ops.pagedq.rotary(x, positions, cos, sin)
    return x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """pagedq_kernels.torch_ops.silu_and_mul in one C++ pass for bfloat16 (torch's roundings); float32 stays in torch, whose
    SiLU the float32 greedy parity is held to."""
    rows = x.reshape(-1, x.shape[-1])
    inter = x.shape[-1] // 2
    fused = x.dtype == torch.bfloat16 and inter % 16 == 0 and rows.stride(-1) == 1 and _silu_and_mul_built()
    if not fused:
        return torch_ops.silu_and_mul(x)
    out = torch.empty((rows.shape[0], inter), dtype=x.dtype)
    torch.ops.pagedq.silu_and_mul(rows, out)
    return out.view(*x.shape[:-1], inter)


@functools.cache
def _silu_and_mul_built() -> bool:
    return bool(torch.ops.pagedq.silu_and_mul_built())


# Linear layers on weight panels (pagedq_kernels/cpu_linear.cpp), for engine.weights.packed.


def linear_paths() -> dict[str, str]:
    """dtype name -> how this CPU multiplies its panels ("amx", "avx512_bf16", "avx512"), for the dtypes it can; and
    "quantized" -> "avx512_vnni", "avx_vnni" or "avx2" where quantized weights have a kernel (engine.weights.quantized)."""
    paths = {dtype: torch.ops.pagedq.panel_linear_path(dtype) for dtype in ("float32", "bfloat16")}
    paths["quantized"] = torch.ops.pagedq.quant_linear_path()  # weights kept quantized (pagedq_kernels/cpu_quant.cpp)
    return {dtype: path for dtype, path in paths.items() if path}


def panel_pack(weight: torch.Tensor, gated: bool) -> torch.Tensor:
    """A bfloat16 or float32 [N, K] weight (K a multiple of 32) as panels of 32 columns. gated (bfloat16): [gate; up]
    rows of an MLP (N/2 a multiple of 16), packed so that panel_linear returns silu(gate) * up."""
    return torch.ops.pagedq.panel_pack(weight.detach(), weight.shape[0] // 2 if gated else 0)


def panel_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, gated: bool,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T (+ a float32 bias), or silu(gate) * up when gated: [..., N] or [..., N/2]. out: a
    contiguous [rows, N] buffer to write into instead of a new tensor (rows = x's leading dimensions)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out is None:
        out = torch.ops.pagedq.panel_linear(rows, packed, bias, n, gated)
    else:
        torch.ops.pagedq.panel_linear_out(rows, packed, bias, n, gated, out)
    return out.view(*x.shape[:-1], out.shape[-1])


# The whole decoder stack in one C++ call a step (pagedq_kernels/cpu_model.cpp), for engine.models.llama.


class Decoder:
    """A Llama-family decoder stack on these kernels: the same ops, order and roundings as the Python model on this
    backend, without the few hundred op calls from Python a step makes."""

    LAYER = ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down",
             "down_bias", "q_norm", "k_norm", "k_cache", "v_cache")  # pagedq_kernels/cpu_model.h's order

    def __init__(self, layers: list[dict[str, torch.Tensor | None]], embed: torch.Tensor, norm: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, dims: tuple[int, ...], eps: float, scale: float) -> None:
        """layers: per layer, tensors named as in LAYER (None where absent: a bias, Qwen3's q/k norms); dims: hidden,
        query heads, KV heads, head dim, intermediate size, gated (1 where gate_up returns silu(gate) * up)."""
        absent = torch.empty(0)
        tensors = [t if (t := layer.get(name)) is not None else absent for layer in layers for name in self.LAYER]
        self.impl = torch.classes.pagedq.Decoder(tensors + [embed, norm, cos, sin], list(dims), eps, scale)

    @staticmethod
    def fits(head_dim: int, group: int) -> bool:
        """Whether decode and prefill attention both have a kernel for this head shape (else: the Python model)."""
        return _prefill_built(head_dim, group)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, plan: dict
                 ) -> torch.Tensor:
        """The final norm's output [T, hidden] of a flat token batch (AttnContext's tensors and plan)."""
        p = plan.get(__name__) or _Plan.of(query_start_loc, seq_lens, block_table)
        plan[__name__] = p
        return self.impl.forward(input_ids, positions.long(), slot_mapping.to(torch.int64).contiguous(),
                                 p.query_start_loc, p.seq_lens, p.block_table, p.decode_rows, p.decode_seqs,
                                 p.prefill_seqs)


_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (pagedq_kernels/cpu_sampling.cpp): the greedy tokens of [rows, vocab] logits."""
    vocab_rows = logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[1] > 0
    if not vocab_rows or logits.dtype not in _ARGMAX_DTYPES:
        return torch_ops.argmax(logits)
    return torch.ops.pagedq.argmax_rows(logits)
