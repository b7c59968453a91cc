"""What a step costs by the tokens in it: where a forward turns from reading weights to computing. The speculation
policy's doubling_tokens (engine.config.DOUBLING_TOKENS) is the tokens at which a step costs twice a one-token step.
Measured as the verify step measures it: one sequence, its last token and k draft tokens in one query.

    python -m bench.step_costs [--model smollm2-135m-instruct] [--quantization none] [--sizes 1 2 4 8 16 32 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sequence import Sequence


class _Drafts:
    """Every sequence gets exactly k drafts a step (made-up tokens: what they cost is the point, not whether they
    land)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [[100 + i for i in range(min(k, self.k))] for _, k in wants]

    def plan(self, seqs: list[Sequence], limits: list[int], num_tokens: int, num_samplers: int) -> list[int]:
        return [min(self.k, limit) for limit in limits]

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        pass

    def finished(self, seq: Sequence) -> None:
        pass

    forget = finished


def step_seconds(eng: LLMEngine, tokens: int, context: int, steps: int) -> float:
    """Median seconds of a step of one sequence, `context` tokens in, computing `tokens` tokens (k = tokens - 1
    drafts)."""
    spec = eng.loop.speculator
    spec.proposer = spec.policy = _Drafts(tokens - 1)
    params = SamplingParams(max_tokens=steps * tokens + 2, temperature=0, ignore_eos=True)
    eng.add_request(f"t{tokens}", prompt_token_ids=[(7 * j) % 1000 + 100 for j in range(context)], params=params)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        eng.step()
        batch = eng.last_batch  # its drafts are out of its rows again: num_drafts tells them
        if batch.num_tokens == 1 and sum(batch.num_drafts) + 1 == tokens and batch.seqs[0].num_computed_tokens > context:
            times.append(time.perf_counter() - start)
    eng.abort(f"t{tokens}")
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
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17, 33, 65])
    ap.add_argument("--context", type=int, default=512, help="tokens the sequence has before its measured steps")
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    eng = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization, num_kv_blocks=512,
                                 speculative="ngram", num_speculative_tokens=max(args.sizes)))
    step_seconds(eng, 2, 32, 4)  # warm-up
    costs = {size: step_seconds(eng, size, args.context, args.steps) for size in sorted({1, *args.sizes})}
    for size, s in costs.items():
        print(f"{size:4d} tokens: {1000 * s:7.1f} ms/step  {s / costs[1]:5.2f}x one token")
    print(f"doubling_tokens ~ {doubling(costs):.0f}")


if __name__ == "__main__":
    main()
