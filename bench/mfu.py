"""Model FLOP utilisation: model FLOP/s achieved over the FLOP/s of a large matmul measured in the same run."""

from __future__ import annotations

import time

import torch


def matmul_peak(device: str, dtype: torch.dtype, size: int | None = None, seconds: float = 2.0) -> dict:
    """Best FLOP/s of an n x n x n matmul on this device: the practical ceiling the model runs against."""
    gpu = device.startswith("cuda")
    n = size or (8192 if gpu else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(device)

    torch.matmul(a, b)  # first call pays for allocation and kernel selection
    sync()
    best, spent, reps = float("inf"), 0.0, 0
    while spent < seconds or reps < 3:
        t = time.perf_counter()
        torch.matmul(a, b)
        sync()
        dt = time.perf_counter() - t
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return {"flops_per_s": 2 * n**3 / best, "size": n, "dtype": str(dtype).removeprefix("torch."), "reps": reps}


def memory_bandwidth(device: str, nbytes: int = 512 << 20, seconds: float = 1.0) -> dict:
    """Best bytes per second this device streams: copying a buffer far larger than any cache (bytes copied, each read
    and written once) and reading one (a sum). A decode step at batch 1 reads every weight once: the read figure is
    its floor."""
    gpu = device.startswith("cuda")
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)

    def best(fn) -> float:
        fn()
        shortest, spent, reps = float("inf"), 0.0, 0
        while spent < seconds or reps < 3:
            t = time.perf_counter()
            fn()
            if gpu:
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t
            shortest, spent, reps = min(shortest, dt), spent + dt, reps + 1
        return nbytes / shortest

    return {"copy_bytes_per_s": best(lambda: dst.copy_(src)), "read_bytes_per_s": best(src.sum), "bytes": nbytes}


def weight_bytes(params: dict, dtype: torch.dtype) -> int:
    """Bytes a decode step reads at batch 1: every matmul weight once (the lm_head too, tied or not), the input
    embedding only a row per token."""
    return (params["body"] + params["lm_head"]) * torch.empty((), dtype=dtype).element_size()


def param_counts(model: torch.nn.Module) -> dict:
    """Parameters by role. The input embedding is a lookup, not a matmul; the lm_head is a matmul that only
    runs where a token is sampled, so the two are kept apart from the rest (the body)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    embed = head = 0
    tied = False
    for name, mod in model.named_modules():
        if name.endswith("embed_tokens") and isinstance(mod, torch.nn.Embedding):
            embed = mod.weight.numel()
            embed_w = mod.weight
        elif name.endswith("lm_head") and isinstance(mod, torch.nn.Linear):
            head = mod.weight.numel()
            head_w = mod.weight
    if embed and head:
        tied = embed_w is head_w
    body = total - embed - (0 if tied else head)
    return {"total": total, "embedding": embed, "lm_head": head, "tied": tied, "body": body}


def model_flops(params: dict, prompt_tokens: int, output_tokens: int) -> float:
    """2 x parameters x tokens: every token runs the body; only generated tokens run the lm_head.
    Attention's own FLOPs are left out, as is usual for MFU. prompt_tokens: those the model ran, without prefix-cache
    hits, which cost nothing."""
    return 2.0 * params["body"] * (prompt_tokens + output_tokens) + 2.0 * params["lm_head"] * output_tokens


def run_flops(params: dict, run) -> float:
    """A Run's model FLOPs: the prompt tokens the model ran (no prefix-cache hits) and the outputs asked for."""
    return model_flops(params, run.computed_prompt_tokens, run.output_tokens)
