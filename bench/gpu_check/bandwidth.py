"""Section 2, bandwidth: decode attention timed inside CUDA graphs over block tables that outgrow the L2, as a
fraction of a device-to-device copy's bandwidth."""

from __future__ import annotations

import functools
import gc
import math
import statistics
import time

from bench.gpu_check.common import (
    Budget,
    sweep,
)

BATCHES = (1, 8, 64, 256)
CONTEXTS = (512, 2048, 8192)
# (Hq, Hkv, head_dim, block_size): SmolLM2-135M first (the targets are read on it), then a Llama-3-8B layout
BANDWIDTH_SHAPES = ((9, 3, 64, 16), (32, 8, 128, 16))
ROTATE_BYTES = 256 << 20  # K/V a graph pass reads before it reads any again: several times an H100/H200's L2
GRAPH_SECONDS = 0.01  # work captured in one timing graph


def per_call(calls: list, device: str, replays: int = 10) -> tuple[float, int]:
    """(seconds per call, calls captured) of a list of calls replayed as one CUDA graph: a call's launch costs
    nothing there, and a pass over calls that read different memory keeps the L2 from serving them. The median
    of `replays` replays. On a CPU (a smoke run) the calls just run in a loop."""
    import torch

    for c in calls:  # compiles, split-K workspaces: never inside a capture
        c()
    if not device.startswith("cuda"):
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) / len(calls), len(calls)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in calls:
        c()
    end.record()
    end.synchronize()
    one_pass = max(start.elapsed_time(end) / 1000, 1e-6)  # launches included: an overestimate
    repeats = max(1, min(math.ceil(GRAPH_SECONDS / one_pass), 2000 // len(calls)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            for c in calls:
                c()
    graph.replay()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del graph
    n = repeats * len(calls)
    return statistics.median(times) / n, n


def copy_bandwidth(device: str, size: int = 512 << 20) -> float:
    """Bytes moved per second (read + written) by a device-to-device copy of `size` bytes, in a CUDA graph."""
    import torch

    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds, _ = per_call([functools.partial(dst.copy_, src)], device)
    return 2 * size / seconds


def attention_bandwidth(device: str, budget: Budget, model: str = "", smoke: bool = False,
                        shapes=BANDWIDTH_SHAPES, batches=BATCHES, contexts=CONTEXTS) -> dict:
    """Decode attention in bf16 (fp16 on a CPU) over a paged cache whose blocks are shuffled."""
    import torch

    from pagedq_kernels import triton_ops

    dtype = torch.float16 if smoke else torch.bfloat16
    if smoke:
        shapes, batches, contexts = ((4, 2, 32, 16),), (1, 2), (32, 64)
    copy_bw = copy_bandwidth(device, 1 << 20 if smoke else 512 << 20)
    out: dict = {"dtype": str(dtype).removeprefix("torch."), "copy_gb_per_s": copy_bw / 1e9, "cases": [],
                 "timing": "CUDA graph of many calls over rotating block tables, median of 10 replays"}
    pool: dict = {}
    grid = [(s, b, c) for s in shapes for b in batches for c in contexts]
    for (hq, hkv, d, bs), batch, ctx in sweep(budget, grid, out):
        if pool.get("shape") != (hq, hkv, d, bs):
            pool.clear()
            gc.collect()
            blocks = max(batches) * max(contexts) // bs
            pool.update(shape=(hq, hkv, d, bs), blocks=blocks,
                        k=torch.randn(blocks, bs, hkv, d, device=device, dtype=dtype),
                        v=torch.randn(blocks, bs, hkv, d, device=device, dtype=dtype),
                        perm=torch.randperm(blocks, device=device).to(torch.int32))
        per_seq = ctx // bs
        need = batch * per_seq
        kv_bytes = 2 * batch * ctx * hkv * d * pool["k"].element_size()
        rotate = max(1, min(pool["blocks"] // need, math.ceil(ROTATE_BYTES / kv_bytes)))
        tables = [pool["perm"][i * need:(i + 1) * need].view(batch, per_seq) for i in range(rotate)]
        q = torch.randn(batch, hq, d, device=device, dtype=dtype)
        qsl = torch.arange(batch + 1, device=device, dtype=torch.int32)
        lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
        calls = [functools.partial(triton_ops.paged_attention, q, pool["k"], pool["v"], qsl, lens, t, d**-0.5)
                 for t in tables]
        seconds, n = per_call(calls, device)
        out["cases"].append({"shape": f"{hq}/{hkv}x{d} bs{bs}", "batch": batch, "context": ctx, "us": seconds * 1e6,
                             "gb_per_s": kv_bytes / seconds / 1e9, "fraction_of_copy": kv_bytes / seconds / copy_bw,
                             "segments": triton_ops.num_segments(batch, hkv, ctx, q.device), "tables": rotate,
                             "calls_in_graph": n})
    pool.clear()
    return out
