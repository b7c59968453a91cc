"""Perplexity of a model on a fixed text, pagedq's quantized path beside its float path and llama.cpp's.

The text ships with Python itself: the stdlib's pydoc_data topics (the reference manual's prose and examples), topics
in sorted order, cut to the first --tokens tokens. As llama.cpp's llama-perplexity does, the tokens are cut into
chunks of --ctx, each run as one prompt from an empty cache, and only the second half of each chunk is scored (every
scored token sees at least ctx / 2 of context).

    python -m bench.perplexity --model smollm2-135m-instruct --quantization auto none [--llama-cpp BIN]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.report import write_json


def fixed_text(chars: int = 60_000) -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))[:chars]


def chunk_nll(runner, ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of the second half of `ids`, run as one prompt -> (sum, tokens scored)."""
    from engine.models.llama import AttnContext

    n, bs = len(ids), runner.config.block_size
    ctx = AttnContext(slot_mapping=torch.arange(n, dtype=torch.int64),
                      query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                      seq_lens=torch.tensor([n], dtype=torch.int32),
                      block_table=torch.arange(-(-n // bs), dtype=torch.int32)[None], backend=runner.backend)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids), torch.arange(n), ctx)
        logp = torch.log_softmax(runner.model.logits(hidden[n // 2 - 1:n - 1]).float(), -1)
    target = torch.tensor(ids[n // 2:])
    return -logp.gather(1, target[:, None]).sum().item(), len(target)


def pagedq_perplexity(model: str, quantization: str, dtype: str, tokens: int, ctx: int) -> dict:
    from engine import EngineConfig, LLMEngine

    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model, quantization=quantization, dtype=dtype, max_num_seqs=1,
                                    num_kv_blocks=ctx // 16 + 2))
    load_s = time.perf_counter() - start
    ids = engine.tokenizer(fixed_text())["input_ids"][:tokens]
    nll = count = 0.0
    start = time.perf_counter()
    for at in range(0, len(ids) - ctx + 1, ctx):
        s, n = chunk_nll(engine.runner, ids[at:at + ctx])
        nll, count = nll + s, count + n
    formats = sorted({r.format for r in engine.runner.quantized}) or [dtype]
    return {"system": "pagedq", "quantization": quantization, "dtype": dtype, "formats": formats,
            "tokens": len(ids), "scored": int(count), "ppl": math.exp(nll / count), "load_s": load_s,
            "eval_s": time.perf_counter() - start}


def llama_cpp_perplexity(binary: str, gguf: str, tokens: int, ctx: int, threads: int) -> dict:
    """llama-perplexity on the same text (its own tokenizer; the same chunks of ctx, scored the same way)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(fixed_text())
        f.flush()
        chunks = tokens // ctx
        start = time.perf_counter()
        run = subprocess.run([binary, "-m", gguf, "-f", f.name, "-c", str(ctx), "-b", str(ctx), "-t", str(threads),
                              "--chunks", str(chunks)], capture_output=True, text=True, timeout=3600)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    if not found:
        raise RuntimeError(f"llama-perplexity printed no estimate: {(run.stdout + run.stderr)[-2000:]}")
    return {"system": "llama.cpp", "quantization": "gguf", "chunks": chunks, "ppl": float(found.group(1)),
            "eval_s": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", nargs="+", default=["auto", "none"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--llama-cpp", help="llama-perplexity binary: also run llama.cpp on the model's GGUF")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write the results here as JSON")
    a = ap.parse_args()
    results = [pagedq_perplexity(a.model, q, a.dtype, a.tokens, a.ctx) for q in a.quantization]
    if a.llama_cpp:
        from engine.weights.loader import gguf_source

        results.append(llama_cpp_perplexity(a.llama_cpp, str(gguf_source(a.model)), a.tokens, a.ctx, a.threads))
    for r in results:
        print(json.dumps(r))
    if a.out:
        write_json(results, Path(a.out).parent, Path(a.out).name)


if __name__ == "__main__":
    main()
