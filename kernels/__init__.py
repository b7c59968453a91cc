"""Attention ops behind one interface.

Per layer the KV cache is `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim].
`store_kv` writes new keys and values into their slots; `paged_attention` attends a flat batch of new tokens
(prefill, chunked prefill, prefix-cache hits and decode mixed) to the cache through per-sequence block tables.
The torch implementation is the CPU path and the oracle for the Triton kernels.
"""

from __future__ import annotations

from kernels import torch_ops

__all__ = ["get_backend", "paged_attention", "store_kv", "torch_ops"]

store_kv = torch_ops.store_kv
paged_attention = torch_ops.paged_attention


def get_backend(name: str, device: str):
    """The module (with `store_kv` and `paged_attention`) for an attention backend name."""
    if name == "auto":
        name = "torch"
        if device.startswith("cuda"):
            try:
                import kernels.triton_ops  # noqa: F401

                name = "triton"
            except ImportError:
                pass
    if name == "torch":
        return torch_ops
    if name == "triton":
        try:
            from kernels import triton_ops
        except ImportError as e:
            raise ValueError(f"attention_backend='triton' is not available here: {e}") from e
        return triton_ops
    raise ValueError(f"unknown attention backend {name!r}: use 'auto', 'torch' or 'triton'")
