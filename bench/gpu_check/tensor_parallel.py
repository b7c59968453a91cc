"""Section 5, tensor_parallel: one replica over N GPUs against one GPU, greedy tokens and decode steps/s."""

from __future__ import annotations

from bench.gpu_check.common import (
    Budget,
    sweep,
)
from bench.gpu_check.graphs import _engine, compare, drive, equality_requests, steady
from bench.gpu_check.models import model_folder
from engine.config import DEFAULT_MODEL

TP_BATCHES = (1, 8, 64)


def tensor_parallel_check(device: str, budget: Budget, model: str = DEFAULT_MODEL, smoke: bool = False,
                          size: int = 1, batches=TP_BATCHES, steps: int = 64) -> dict:
    """One replica over `size` devices against one device: greedy tokens, then decode steps/s at each batch."""
    if size < 2:
        return {"status": "skipped", "why": "give --tensor-parallel-size N (N > 1) to check a replica over N GPUs"}
    if smoke:
        batches, steps = (1, 2), 3
    dtype = "float32" if smoke else "bfloat16"
    folder, weights = model_folder(model)
    out: dict = {"model": str(folder), "weights": weights, "size": size, "dtype": dtype, "cases": [], "failures": []}
    graphs = device.startswith("cuda")
    one = _engine(folder, device, dtype, graphs, max(batches))
    many = _engine(folder, device, dtype, graphs, max(batches), tensor_parallel_size=size)
    try:
        out["captured"] = many.runner.graphs is not None
        if graphs and not out["captured"]:
            out["failures"].append("the tensor-parallel engine captured no CUDA graphs")
        requests = equality_requests(one.vocab_size)
        out["equality"] = compare(drive(many, requests, "tp"), drive(one, requests), requests, one, dtype,
                                  names=("parallel", "one"))
        if not out["equality"]["ok"]:
            out["failures"].append(f"{size} ranks' tokens differ from one device's beyond a near tie")
        for batch in sweep(budget, batches, out, "batch sizes"):
            for ranks, engine in ((size, many), (1, one)):
                out["cases"].append({"ranks": ranks, **steady(engine, batch, steps, device, check_sync=False)})
    finally:
        many.close()
        one.close()
    rate = {(r["batch"], r["ranks"]): r["steps_per_s"] for r in out["cases"] if "steps_per_s" in r}
    out["speedup"] = {str(b): rate[(b, size)] / rate[(b, 1)] for b in batches if (b, size) in rate and (b, 1) in rate}
    out["status"] = "failed" if out["failures"] else "partial" if out.get("stopped") else "ok"
    return out
