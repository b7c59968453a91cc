"""What a decode step costs by the tokens in it: where a forward turns from reading weights to computing. The
speculation policy's doubling_tokens (engine.config.DOUBLING_TOKENS) is the tokens at which a step costs twice a
one-token step.

    python -m bench.step_costs [--model smollm2-135m-instruct] [--quantization none] [--sizes 1 2 4 8 16 32 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine import EngineConfig, LLMEngine, SamplingParams


def step_seconds(eng: LLMEngine, size: int, context: int, steps: int) -> float:
    """Median seconds of a decode step of `size` sequences, each `context` tokens in."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for i in range(size):
        eng.add_request(f"s{size}-{i}", prompt_token_ids=[(7 * i + j) % 1000 + 100 for j in range(context)],
                        params=params)
    times = []
    while eng.has_unfinished_requests():
        start = time.perf_counter()
        eng.step()
        if len(eng.last_batch.seqs) == size and eng.last_batch.num_tokens == size:  # decode steps only
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def doubling(costs: dict[int, float]) -> float:
    """Tokens at which a step costs twice the one-token step: linear between the sizes measured."""
    base = costs[1]
    sizes = sorted(costs)
    for lo, hi in zip(sizes, sizes[1:]):
        if costs[hi] >= 2 * base:
            return lo + (hi - lo) * (2 * base - costs[lo]) / (costs[hi] - costs[lo])
    return float(sizes[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EngineConfig.model)
    ap.add_argument("--quantization", default=EngineConfig.quantization)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--context", type=int, default=256, help="tokens each sequence has before its decode steps")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    eng = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization, num_kv_blocks=2048))
    step_seconds(eng, 1, 32, 4)  # warm-up
    costs = {size: step_seconds(eng, size, args.context, args.steps) for size in sorted({1, *args.sizes})}
    for size, s in costs.items():
        print(f"{size:4d} tokens: {1000 * s:7.1f} ms/step  {s / costs[1]:5.2f}x one token")
    print(f"doubling_tokens ~ {doubling(costs):.0f}")


if __name__ == "__main__":
    main()
