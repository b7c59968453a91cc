"""Section 3, graphs: CUDA graph replay against eager, greedy, token for token; decode steps/s of both with host
syncs forbidden in the steady loop."""

from __future__ import annotations

import contextlib
import gc
import random
import time
from pathlib import Path

from bench.gpu_check.common import (
    Budget,
    _sync,
    _tail,
    sweep,
)
from bench.gpu_check.models import model_folder
from engine.config import DEFAULT_MODEL

GRAPH_BATCHES = (1, 8, 64)
GRAPH_DTYPES = ("bfloat16", "float32")  # the CUDA default, then float32 where a near tie is rare
# A graph token that differs from eager's passes only if eager's own logprobs of the two are this close.
TIE = {"bfloat16": 0.2, "float16": 0.05, "float32": 0.01}


def _engine(folder: Path, device: str, dtype: str, graphs: bool, max_num_seqs: int, tensor_parallel_size: int = 1):
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(folder), device=device, dtype=dtype, enforce_eager=not graphs,
                                  max_num_seqs=max_num_seqs, num_kv_blocks=4096,
                                  tensor_parallel_size=tensor_parallel_size))


def equality_requests(vocab: int, n: int = 12, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): lengths that differ, so that the batch shrinks through the padded graph sizes."""
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(5 + (11 * i) % 50)], 6 + (7 * i) % 35) for i in range(n)]


def drive(engine, requests: list[tuple[list[int], int]], tag: str = "eq") -> list[list[int]]:
    """Greedy tokens of every request: two thirds start together, the rest join three steps later (mixed steps
    between decode steps); the same calls on every engine, so the batches are the same."""
    from engine import SamplingParams

    final: dict[str, list[int]] = {}
    ids = [f"{tag}-{i}" for i in range(len(requests))]
    first = -(-2 * len(requests) // 3)

    def add(i: int) -> None:
        prompt, max_tokens = requests[i]
        engine.add_request(ids[i], prompt_token_ids=prompt,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))

    for i in range(first):
        add(i)
    steps = 0
    while len(final) < len(ids):
        if steps == 3:
            for i in range(first, len(requests)):
                add(i)
        for o in engine.step():
            if o.finished:
                final[o.request_id] = list(o.token_ids)
        steps += 1
        if steps > 10_000:
            raise RuntimeError("the engine did not finish the requests")
    return [final[r] for r in ids]


def near_tie(engine, prompt: list[int], a: int, b: int) -> float | None:
    """logprob(b) - logprob(a) of the token after `prompt`, from `engine`; None when either is outside its top 20."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=20)
    top = engine.generate([prompt], params)[0].logprobs[0][1]
    return top[b] - top[a] if a in top and b in top else None


def compare(graph_tokens, eager_tokens, requests, eager_engine, dtype: str, names=("graph", "eager")) -> dict:
    """Token-for-token equality; each divergence checked for a near tie by the eager engine's logprobs. names: what
    the two runs are, in each divergence's keys ("graph_token", "eager_token")."""
    tested, reference = (f"{name}_token" for name in names)
    divergences = []
    for i, (g, e) in enumerate(zip(graph_tokens, eager_tokens)):
        if g == e:
            continue
        p = next((j for j, (x, y) in enumerate(zip(g, e)) if x != y), min(len(g), len(e)))
        row = {"request": i, "position": p, tested: g[p] if p < len(g) else None,
               reference: e[p] if p < len(e) else None, "gap": None}
        if row[tested] is not None and row[reference] is not None:
            row["gap"] = near_tie(eager_engine, requests[i][0] + e[:p], row[tested], row[reference])
        row["explained"] = row["gap"] is not None and abs(row["gap"]) <= TIE[dtype]
        divergences.append(row)
    return {"dtype": dtype, "requests": len(requests), "tokens": sum(map(len, eager_tokens)),
            "equal_requests": len(requests) - len(divergences), "divergences": divergences,
            "tie_tolerance": TIE[dtype], "ok": all(d["explained"] for d in divergences)}


def _is_host_sync(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and "synchroniz" in str(e)


@contextlib.contextmanager
def no_host_sync(device: str, on: bool = True):
    """torch.cuda.set_sync_debug_mode("error") inside (CUDA only): an op that makes the host wait raises."""
    import torch

    if not (on and device.startswith("cuda")):
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def steady(engine, batch: int, steps: int, device: str, check_sync: bool = True) -> dict:
    """Decode steps/s of `batch` requests once every step is decode only, with the host-sync check around the
    loop. A caught sync ends the loop: the row says so, and the engine is left mid-step (build another)."""
    import uuid

    from engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    tag = uuid.uuid4().hex[:6]
    vocab = min(engine.vocab_size, 500)
    for i in range(batch):
        engine.add_request(f"steady-{tag}-{i}", prompt_token_ids=[3 + (i * 7 + j) % (vocab - 3) for j in range(32)],
                           params=params)
    for _ in range(3):  # the prefill, then decode steps until the step loop runs ahead of the device
        engine.step()
    _sync(device)
    row = {"batch": batch, "captured": engine.runner.graphs is not None,
           "sync_checked": check_sync and device.startswith("cuda")}
    t0 = time.perf_counter()
    try:
        with no_host_sync(device, check_sync):
            for _ in range(steps):
                engine.step()
    except Exception as e:
        if not _is_host_sync(e):
            raise
        row.update(host_sync=str(e).splitlines()[0], where=_tail(e, 4, ("engine", "pagedq_kernels")))
        return row
    _sync(device)
    row["steps_per_s"] = steps / (time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    return row


def graph_check(device: str, budget: Budget, model: str = DEFAULT_MODEL, smoke: bool = False,
                batches=GRAPH_BATCHES, steps: int = 64, dtypes=GRAPH_DTYPES) -> dict:
    if smoke:
        batches, steps, dtypes = (1, 2), 3, ("float32",)
    folder, weights = model_folder(model)
    out: dict = {"model": str(folder), "weights": weights, "equality": [], "cases": [], "failures": []}
    for i, dtype in enumerate(sweep(budget, dtypes, out, "dtypes")):
        try:
            # steps/s and the host-sync check in the first dtype (the CUDA default), tokens in every one
            _graphs_in(dtype, out, folder, device, budget, batches if i == 0 else (), steps)
        except Exception as e:  # noqa: BLE001 (the next dtype still runs)
            out["failures"].append(f"{dtype}: {type(e).__name__}: {e} at {', '.join(_tail(e))}")
        gc.collect()
    rate = {(r["batch"], r["graphs"]): r["steps_per_s"] for r in out["cases"] if "steps_per_s" in r}
    out["speedup"] = {str(b): rate[(b, True)] / rate[(b, False)] for b in batches
                      if (b, True) in rate and (b, False) in rate}
    out["status"] = "failed" if out["failures"] else "partial" if out.get("stopped") else "ok"
    return out


def _graphs_in(dtype: str, out: dict, folder: Path, device: str, budget: Budget, batches, steps: int) -> None:
    """One dtype of graph_check: an engine with CUDA graphs and an eager one, the same requests through both, then
    the steady loop of each at every batch size."""

    def build(graphs: bool):
        return _engine(folder, device, dtype, graphs, max(batches, default=16))

    engines = {True: build(True), False: build(False)}
    if device.startswith("cuda") and engines[True].runner.graphs is None:
        out["failures"].append(f"{dtype}: the engine captured no CUDA graphs")
    requests = equality_requests(engines[False].vocab_size)
    tokens = {g: drive(e, requests) for g, e in engines.items()}
    eq = compare(tokens[True], tokens[False], requests, engines[False], dtype)
    out["equality"].append(eq)
    if not eq["ok"]:
        out["failures"].append(f"{dtype}: graph replay's tokens differ from eager's beyond a near tie")
    for batch in sweep(budget, batches, out, "batch sizes"):
        for graphs in (True, False):
            row = {"graphs": graphs, **steady(engines[graphs], batch, steps, device)}
            if "host_sync" in row:  # reported; then measured again without the check, on a fresh engine
                out["failures"].append(f"host sync in the steady decode loop ({'graphs' if graphs else 'eager'}, "
                                       f"batch {batch}): {row['host_sync']} at {', '.join(row['where'])}")
                out["cases"].append(row)
                engines[graphs] = build(graphs)
                row = {"graphs": graphs, **steady(engines[graphs], batch, steps, device, check_sync=False)}
            out["cases"].append(row)
