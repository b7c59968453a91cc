"""Runs vLLM on the benchmark's workloads, inside the virtual environment where the user installed vLLM.

Standalone on purpose: it imports vLLM and the standard library only, never pagedq, because it runs under another
Python. `bench.vllm_peer` writes the job as JSON and reads the answer back:

    python vllm_runner.py job.json answer.json

job: {"model": folder, "dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
      "sets": [{"name", "warm": [[prompt_ids, max_tokens], ...], "timed": [...]}]}
answer: {"version", "startup_s", "results": {name: {"elapsed_s", "outputs": [[produced, cached_tokens], ...]}}}
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, answer_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    t = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=job["max_num_seqs"],
              max_num_batched_tokens=job["max_num_batched_tokens"], max_model_len=job["max_model_len"], seed=0)
    startup = time.perf_counter() - t

    def run(requests: list) -> tuple[float, list]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        return elapsed, [[len(o.outputs[0].token_ids), o.num_cached_tokens or 0] for o in outs]

    results = {}
    for s in job["sets"]:
        run(s["warm"])  # untimed: first-call costs of this shape stay out of the figure
        elapsed, outputs = run(s["timed"])
        results[s["name"]] = {"elapsed_s": elapsed, "outputs": outputs}
        print(f"vllm: {s['name']}: {sum(p for p, _ in outputs) / elapsed:.1f} out tok/s", file=sys.stderr, flush=True)
    with open(answer_path, "w") as f:
        json.dump({"version": vllm.__version__, "startup_s": startup, "results": results}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
