"""Attention ops behind one interface.

Per layer the KV cache is `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim].
`store_kv` writes new keys and values into their slots; `paged_attention` attends a flat batch of new tokens
(prefill, chunked prefill, prefix-cache hits and decode mixed) to the cache through per-sequence block tables.
The torch implementation is the CPU path and the oracle for the Triton kernels (kernels.triton_ops, the CUDA
path; imported only when asked for, so that TRITON_INTERPRET can be set first).
"""

from __future__ import annotations

from kernels import torch_ops

__all__ = ["get_backend", "paged_attention", "store_kv", "torch_ops"]

store_kv = torch_ops.store_kv
paged_attention = torch_ops.paged_attention


def get_backend(name: str, device: str):
    """The module (with `store_kv` and `paged_attention`) for an attention backend name.

    "auto" is the Triton kernels on CUDA and torch elsewhere; "triton" where the kernels cannot run (no CUDA, no
    TRITON_INTERPRET=1) is a ValueError rather than a silent fallback.
    """
    if name == "auto":
        name = "triton" if device.startswith("cuda") else "torch"
    if name == "torch":
        return torch_ops
    if name == "triton":
        try:
            from kernels import triton_ops
        except ImportError as e:
            raise ValueError(f"attention_backend='triton' is not available here: {e}") from e
        why = triton_ops.runnable(device)
        if why:
            raise ValueError(f"attention_backend='triton' cannot run here: {why}; use attention_backend='torch'")
        return triton_ops
    raise ValueError(f"unknown attention backend {name!r}: use 'auto', 'torch' or 'triton'")
