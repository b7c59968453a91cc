"""Attention ops behind one interface.

Per layer the KV cache is `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim].
`store_kv` writes new keys and values into their slots; `paged_attention` attends a flat batch of new tokens
(prefill, chunked prefill, prefix-cache hits and decode mixed) to the cache through per-sequence block tables.
The torch implementation is the oracle for the other two: the C++ decode attention of the CPU path
(kernels.cpu_ops) and the Triton kernels (kernels.triton_ops, the CUDA path; imported only when asked for, so that
TRITON_INTERPRET can be set first).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from kernels import torch_ops

log = logging.getLogger("pagedq.kernels")

__all__ = ["get_backend", "paged_attention", "store_kv", "torch_ops"]

store_kv = torch_ops.store_kv
paged_attention = torch_ops.paged_attention


def get_backend(name: str, device: str, build_root: Path | None = None):
    """The module (with `store_kv` and `paged_attention`) for an attention backend name.

    "auto" is the Triton kernels on CUDA and, on a CPU, the C++ decode attention (kernels.cpu_ops, built under
    `build_root` on first use), or the torch ops where it cannot be built (logged, with why). An explicit name
    that cannot run here ("triton" without CUDA or TRITON_INTERPRET=1, "cpu" without a compiler) is a ValueError
    rather than a silent fallback.
    """
    if name == "auto":
        if device.startswith("cuda"):
            name = "triton"
        else:
            return _cpu_ops(build_root, fallback=True)
    if name == "torch":
        return torch_ops
    if name == "cpu":
        return _cpu_ops(build_root, fallback=False)
    if name == "triton":
        try:
            from kernels import triton_ops
        except ImportError as e:
            raise ValueError(f"attention_backend='triton' is not available here: {e}") from e
        why = triton_ops.runnable(device)
        if why:
            raise ValueError(f"attention_backend='triton' cannot run here: {why}; use attention_backend='torch'")
        return triton_ops
    raise ValueError(f"unknown attention backend {name!r}: use 'auto', 'torch', 'cpu' or 'triton'")


def _cpu_ops(build_root: Path | None, fallback: bool):
    from kernels import cpu_ops

    why = cpu_ops.load(build_root or Path(tempfile.gettempdir()) / "pagedq-kernels")
    if why is None:
        return cpu_ops
    if not fallback:
        raise ValueError(f"attention_backend='cpu' cannot run here: {why}; use attention_backend='torch'")
    log.warning("decode attention in torch (gathered copies, slower): %s", why)
    return torch_ops
