"""`pagedq bench --tensor-parallel-size N`: one model replica over N ranks beside one device, on the engine alone.

Throughput on the chat and mixed workloads, the time per output token of steady decoding at batch 1 and 64, and
the share of each step spent in collectives on rank 0 (all-reduces, the step message, the logits' gather), for
tensor_parallel_size 1 and N (N with gloo's all-reduce and with the shared-memory one). The model is a random-weight Llama with heads that split (SmolLM2-135M's 9 heads do
not split over 2 ranks), large enough that a step is the forward's work, not the host's.
"""

from __future__ import annotations

import json
import time

from bench import workloads as wls
from bench.durability import cpu_name
from bench.report import write_json
from bench.systems import run_engine

# hidden 1024, 16 heads (4 KV), 8 layers, MLP 4096, SmolLM2's 49,152-token vocabulary (tied): 172M parameters.
SHAPE = {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16, "num_key_value_heads": 4,
         "num_hidden_layers": 8}
WORKLOADS = {"chat": 6, "mixed": 4}  # requests of each (the full sets' shapes, fewer of them: a 2-core box)
QUICK_WORKLOADS = {"chat": 4, "mixed": 4}
DECODE_BATCHES = (1, 64)
DECODE_STEPS = 8


def bench_model() -> str:
    from bench.random_model import make_tiny_model
    from engine.weights.loader import cache_root

    return make_tiny_model(str(cache_root() / "bench-tp-llama-172m-v1"), "llama", shape=SHAPE)


def run_tensor_parallel(size: int, dtype: str | None, quick: bool, out_dir: str, echo=print) -> dict:
    """Measure tensor_parallel_size 1 and `size` -> the results, also written to out_dir/bench-tensor-parallel.json."""
    from engine import EngineConfig, LLMEngine

    model = bench_model()
    results = {"cpu": cpu_name(), "model": SHAPE, "dtype": dtype or "float32", "runs": []}
    for tp, shm in ((1, False), (size, False), (size, True)):
        engine = LLMEngine(EngineConfig(model=model, dtype=dtype, tensor_parallel_size=tp, max_num_seqs=64,
                                        max_model_len=1024, num_kv_blocks=64 * 1024 // 16, shm_all_reduce=shm))
        try:
            run = {"tensor_parallel_size": tp, "all_reduce": ("shared memory" if shm else "gloo") if tp > 1 else None,
                   "threads_per_rank": _threads(engine)}
            for name, n in (QUICK_WORKLOADS if quick else WORKLOADS).items():
                run[name] = _throughput(engine, name, n)
            for batch in DECODE_BATCHES:
                run[f"decode_batch_{batch}"] = _decode(engine, batch, 4 if quick else DECODE_STEPS)
            results["runs"].append(run)
            echo(json.dumps(run))
        finally:
            engine.close()
    echo(f"wrote {write_json(results, out_dir, 'bench-tensor-parallel.json')}")
    return results


def _threads(engine) -> int:
    import torch

    return torch.get_num_threads()


def _comm(engine) -> dict[str, float]:
    return dict(engine.runner.shard.comm_s)


def _share(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Each collective's share of the wall time between two readings of rank 0's counters."""
    return {k: round((after.get(k, 0.0) - before.get(k, 0.0)) / seconds, 4) for k in after}


def _throughput(engine, name: str, n: int) -> dict:
    wl = wls.build(name, engine.tokenizer, num_requests=n, seed=0)
    before = _comm(engine)
    run = run_engine(engine, wl, progress=False)
    out = run.output_tokens
    return {"requests": n, "output_tokens": out, "seconds": round(run.elapsed, 2),
            "output_tokens_per_s": round(out / run.elapsed, 1), "comm_share": _share(before, _comm(engine), run.elapsed)}


def _decode(engine, batch: int, steps: int) -> dict:
    """Steady decoding of `batch` requests: the time of one step, each request's time per output token."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{batch}-{i}", prompt_token_ids=[100 + i % 50] * 32, params=params)
    while engine.num_decoding() < batch:  # prefill every prompt first
        engine.step()
    before, start = _comm(engine), time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - start
    share = _share(before, _comm(engine), seconds)
    while engine.has_unfinished_requests():
        engine.step()
    return {"tpot_ms": round(1000 * seconds / steps, 2), "comm_share": share}
