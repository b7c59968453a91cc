"""Decode speed of quantized weights against pagedq's own bfloat16, and against llama.cpp on the same GGUF.

For each pagedq configuration (quantization, dtype) this loads the engine, fills `batch` sequences with a short
prompt, and times decode steps alone (engine.step with every sequence decoding; the configurations in turn, the
median of --rounds rounds): ms a step, tokens/s, and the bytes of linear weights a step reads over the step's time
(GB/s), beside the machine's measured copy bandwidth. With
--llamacpp-server, llama-server on the model's GGUF decodes one request of the same length: its own time per token.

    python -m bench.quant_decode --batch 1 16 --out docs/bench/quant-decode-zen4.json --llamacpp-server BIN
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.report import write_json

CONFIGS = [("none", "bfloat16"), ("int8", "bfloat16"), ("auto", "bfloat16"), ("auto", "float32")]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the linear layers' weights as the kernels read them (quantized panels, float panels, or plain)."""
    from engine.weights.packed import PanelLinear

    total = 0
    for m in model.modules():
        if isinstance(m, PanelLinear):
            total += m.packed.numel() * m.packed.element_size()
        elif isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


def decode_steps(engine, batch: int, prompt: int, steps: int) -> float:
    """Seconds a decode step takes with `batch` sequences decoding (prefill done, untimed)."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}-{time.monotonic_ns()}", prompt_token_ids=[(7 * i + j) % 5000 + 100
                                                                                    for j in range(prompt)],
                           params=params)
    for _ in range(4):  # the prompts' prefill (one step: they fit its token budget), then warm decode steps
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def load_pagedq(model: str, quantization: str, dtype: str, batches: list[int]) -> tuple[object, dict]:
    from engine import EngineConfig, LLMEngine

    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model, quantization=quantization, dtype=dtype, max_num_seqs=max(batches),
                                    num_kv_blocks=max(batches) * 16 + 16))
    startup = time.perf_counter() - start
    formats = sorted({r.format for r in engine.runner.quantized}) or [dtype]
    return engine, {"system": "pagedq", "quantization": quantization, "dtype": dtype, "formats": formats,
                    "weight_bytes": weight_bytes(engine.runner.model), "startup_s": startup, "decode": {}}


def run_pagedq(model: str, configs: list[tuple[str, str]], batches: list[int], steps: int, rounds: int) -> list[dict]:
    """Every configuration loaded at once, then timed in rounds that go through all of them in turn: a slow spell
    of the machine (a VM's neighbours) then falls on every configuration alike, and the median round is reported."""
    loaded = [load_pagedq(model, q, d, batches) for q, d in configs]
    times: list[dict[int, list[float]]] = [{b: [] for b in batches} for _ in loaded]
    for _ in range(rounds):
        for (engine, _), row in zip(loaded, times):
            for b in batches:
                row[b].append(decode_steps(engine, b, 32, steps))
    for (_, out), row in zip(loaded, times):
        for b, seconds in row.items():
            step = statistics.median(seconds)
            out["decode"][str(b)] = {"step_ms": step * 1e3, "tokens_per_s": b / step,
                                     "weights_gb_per_s": out["weight_bytes"] / step / 1e9,
                                     "rounds_ms": [s * 1e3 for s in seconds]}
    return [out for _, out in loaded]


def run_llamacpp(server_bin: str, gguf: str, threads: int, tokens: int) -> dict:
    from bench.llamacpp_peer import Server

    server = Server(server_bin, gguf, threads, 1, 512, Path("/tmp/pagedq-llamacpp-decode.log"))
    try:
        server.complete(list(range(100, 132)), 16)  # warm
        res = server.complete(list(range(100, 132)), tokens)
    finally:
        server.close()
    per_token = res["timings"]["predicted_per_token_ms"]
    return {"system": "llama.cpp", "startup_s": server.startup_s,
            "decode": {"1": {"step_ms": per_token, "tokens_per_s": 1e3 / per_token}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="rounds through every configuration; the median is kept")
    ap.add_argument("--configs", nargs="+", default=[f"{q}:{d}" for q, d in CONFIGS],
                    help="quantization:dtype pairs")
    ap.add_argument("--llamacpp-server", help="llama-server binary: also time llama.cpp on the model's GGUF")
    ap.add_argument("--out")
    a = ap.parse_args()
    from bench import mfu, report
    from engine.weights.loader import gguf_source

    data = {"machine": report.machine("cpu"), "memory_bandwidth": mfu.memory_bandwidth("cpu"), "results": []}
    print(json.dumps(data["memory_bandwidth"]))
    for result in run_pagedq(a.model, [tuple(spec.split(":")) for spec in a.configs], a.batch, a.steps, a.rounds):
        data["results"].append(result)
        print(json.dumps(result))
    if a.llamacpp_server:
        data["results"].append(run_llamacpp(a.llamacpp_server, str(gguf_source(a.model)), torch.get_num_threads(),
                                            a.steps * 4))
        print(json.dumps(data["results"][-1]))
    if a.out:
        write_json(data, Path(a.out).parent, Path(a.out).name)


if __name__ == "__main__":
    main()
