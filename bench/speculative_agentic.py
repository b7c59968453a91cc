"""Speculative decoding on an "agentic" stream: one task template over different small inputs, one request after
another (a pipeline worker's day), greedy, speculation off, ngram and suffix, each on a fresh engine: decode tokens/s
over the requests, draft tokens proposed and accepted, and that the texts are the same.

Suffix learns each finished output, so from the second request on it can guess the template's structure, which
prompt lookup finds only where the output copies the prompt.

    python -m bench.speculative_agentic [--quantization none] [--k 4] [--max-tokens 160] [--reps 2]
"""

from __future__ import annotations

import argparse
import time

from engine import EngineConfig, LLMEngine, SamplingParams

TEMPLATE = ("You triage support tickets. Read the ticket and answer with a JSON object with the keys \"customer\", "
            "\"product\", \"problem\", \"priority\" (low, medium or high) and \"next_step\", then one sentence for "
            "the support agent.\n\nTicket:\n{ticket}")
TICKETS = [
    "From: Maria Lopez. My X200 router drops the connection every evening since the last update. I work from home "
    "and this costs me hours. Please help.",
    "From: Tom Becker. The invoice for March charges me twice for the Cloud Backup plan. I would like a refund of "
    "the second charge.",
    "From: Aiko Tanaka. The SmartCam 3 app does not show the live image anymore on my phone, but it works on the "
    "tablet. Not urgent.",
    "From: Jonas Berg. Our office printer P500 shows error E42 and prints nothing. Twelve people cannot print "
    "contracts today.",
    "From: Lena Hofmann. I forgot the password of my account and the reset email never arrives. I checked the spam "
    "folder.",
]
MODES = ("off", "ngram", "suffix")


def measure(model: str, quantization: str, mode: str, k: int, max_tokens: int) -> dict:
    """The tickets one after another on a fresh engine -> decode tokens/s over all of them, counts and texts."""
    eng = LLMEngine(EngineConfig(model=model, quantization=quantization, speculative=mode, num_speculative_tokens=k,
                                 num_kv_blocks=512))
    prompts = [eng.apply_chat_template([{"role": "user", "content": TEMPLATE.format(ticket=t)}]) for t in TICKETS]
    # Warm-up: kernels, allocator. Not a ticket, so the suffix index learns nothing of the template from it.
    eng.generate([prompts[0][:32]], SamplingParams(max_tokens=8, temperature=0))
    spec = eng.speculation
    proposed, accepted = spec.proposed, spec.accepted
    tokens, seconds, texts = 0, 0.0, []
    for i, ids in enumerate(prompts):
        eng.add_request(f"t{i}", prompt_token_ids=ids, params=SamplingParams(max_tokens=max_tokens, temperature=0))
        first, out = None, None
        while eng.has_unfinished_requests():
            for o in eng.step():
                out = o
                first = first or time.perf_counter()  # the prefill step's end: decoding starts here
        seconds += time.perf_counter() - first
        tokens += len(out.token_ids) - 1
        texts.append(out.text)
    return dict(mode=mode, tokens=tokens, decode_tps=tokens / seconds, proposed=spec.proposed - proposed,
                accepted=spec.accepted - accepted, texts=texts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EngineConfig.model)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--reps", type=int, default=2, help="rounds of all modes, interleaved; the best of each is shown")
    args = ap.parse_args()
    best: dict[str, dict] = {}
    for _ in range(args.reps):  # interleaved, so a busy spell of a shared machine hits every mode alike
        for mode in MODES:
            row = measure(args.model, args.quantization, mode, args.k, args.max_tokens)
            print(f"  {mode}: {row['decode_tps']:.1f} tok/s", flush=True)
            if mode not in best or row["decode_tps"] > best[mode]["decode_tps"]:
                best[mode] = row
    off = best["off"]
    for r in best.values():
        rate = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
        print(f"{r['mode']:6} k={args.k} tokens={r['tokens']} decode {r['decode_tps']:6.1f} tok/s "
              f"({r['decode_tps'] / off['decode_tps']:.2f}x)  proposed={r['proposed']} accepted={r['accepted']} "
              f"acceptance={rate:.2f}  same texts: {r['texts'] == off['texts']}")


if __name__ == "__main__":
    main()
