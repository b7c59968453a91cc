"""Attention ops behind one interface, and the kernel backends that implement them.

Per layer the KV cache is `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim].
`store_kv` writes new keys and values into their slots; `paged_attention` attends a flat batch of new tokens
(prefill, chunked prefill, prefix-cache hits and decode mixed) to the cache through per-sequence block tables.
The torch implementation is the oracle for the other two: the C++ kernels of the CPU path (kernels.cpu_ops, built by
kernels.build) and the Triton kernels (kernels.triton_ops, the CUDA path; imported only when asked for, so that
TRITON_INTERPRET can be set first). `get_backend` returns a `Backend`, which says what each supports.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from pagedq_kernels import torch_ops
from pagedq_kernels.backend import TORCH, Backend

log = logging.getLogger("pagedq.kernels")

__all__ = ["Backend", "get_backend", "paged_attention", "store_kv", "torch_ops"]

store_kv = torch_ops.store_kv
paged_attention = torch_ops.paged_attention


def get_backend(name: str, device: str, build_root: Path | None = None) -> Backend:
    """The backend for an attention backend name.

    "auto" is the Triton kernels on CUDA and, on a CPU, the C++ kernels (built under `build_root` on first use), or
    the torch ops where they cannot be built (logged, with why). An explicit name that cannot run here ("triton"
    without CUDA or TRITON_INTERPRET=1, "cpu" without a compiler) is a ValueError rather than a silent fallback.
    """
    if name == "auto":
        if device.startswith("cuda"):
            name = "triton"
        else:
            return _cpu(build_root, fallback=True)
    if name == "torch":
        return TORCH
    if name == "cpu":
        return _cpu(build_root, fallback=False)
    if name == "triton":
        return _triton(device)
    raise ValueError(f"unknown attention backend {name!r}: use 'auto', 'torch', 'cpu' or 'triton'")


def _triton(device: str) -> Backend:
    try:
        from pagedq_kernels import triton_ops
    except ImportError as e:
        raise ValueError(f"attention_backend='triton' is not available here: {e}") from e
    why = triton_ops.runnable(device)
    if why:
        raise ValueError(f"attention_backend='triton' cannot run here: {why}; use attention_backend='torch'")
    # linear_paths: quantized weights run pagedq_kernels/triton_quant.py (engine.weights.quantized)
    return Backend("triton", triton_ops.store_kv, triton_ops.paged_attention, graph_safe=True,
                   copy_blocks=triton_ops.copy_blocks, linear_paths={"quantized": "triton"})


def _cpu(build_root: Path | None, fallback: bool) -> Backend:
    from pagedq_kernels import cpu_ops

    why = cpu_ops.load(build_root or Path(tempfile.gettempdir()) / "pagedq-kernels")
    if why is None:
        return Backend("cpu", cpu_ops.store_kv, cpu_ops.paged_attention, argmax=cpu_ops.argmax, planned=True,
                       layers=cpu_ops, linears=cpu_ops, linear_paths=cpu_ops.linear_paths(), decoder=cpu_ops.Decoder,
                       copy_blocks=cpu_ops.copy_blocks)
    if not fallback:
        raise ValueError(f"attention_backend='cpu' cannot run here: {why}; use attention_backend='torch'")
    log.warning("attention and layers in torch (slower): %s", why)
    return Backend("torch", torch_ops.store_kv, torch_ops.paged_attention, fallback=why)
