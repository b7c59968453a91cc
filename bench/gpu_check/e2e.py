"""Section 4, e2e: the bench's chat and mixed workloads, the engine against transformers static batching and
generate_batch."""

from __future__ import annotations

import gc

from bench.gpu_check.common import (
    Budget,
    _tail,
    sweep,
)
from bench.gpu_check.models import model_folder
from engine.config import DEFAULT_MODEL


def end_to_end(device: str, budget: Budget, model: str = DEFAULT_MODEL, smoke: bool = False,
               max_num_seqs: int = 64, max_num_batched_tokens: int = 2048) -> dict:
    import torch
    from transformers import AutoTokenizer

    from bench import workloads as wls
    from bench.systems import load_hf, run_engine, run_hf_cb, run_hf_static
    from engine import EngineConfig, LLMEngine, SamplingParams

    if smoke:
        max_num_seqs, max_num_batched_tokens = 4, 256
    folder, weights = model_folder(model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sets = {name: wls.build(name, tokenizer, smoke) for name in ("chat", "mixed")}
    longest = max(len(r.prompt_ids) + r.max_tokens for s in sets.values() for r in s.requests)
    out: dict = {"model": str(folder), "weights": weights, "runs": [], "errors": []}
    engine = LLMEngine(EngineConfig(model=str(folder), device=device, max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    num_kv_blocks=max_num_seqs * -(-longest // 16) + max_num_seqs))
    engine.generate(["Warm up.", "Warm up, again."], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    if weights == "real" and getattr(tokenizer, "chat_template", None):
        out["chat_reply"] = engine.generate(
            [engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])],
            SamplingParams(max_tokens=24, temperature=0))[0].text
    hf = None
    plan = [("pagedq", w) for w in sets] + [(p, w) for p in ("hf-static", "hf-cb") for w in sets]
    for system, name in sweep(budget, plan, out, "runs"):
        wl = sets[name]
        try:
            if system == "pagedq":
                result = run_engine(engine, wl, progress=False)
            else:
                if hf is None:
                    del engine
                    engine = None
                    gc.collect()
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
                    hf = load_hf(folder, device, "bfloat16" if device.startswith("cuda") else "float32")
                result = (run_hf_static(hf, wl, max_num_seqs, progress=False) if system == "hf-static" else
                          run_hf_cb(hf, wl, max_num_seqs, max_num_batched_tokens, progress=False))
            out["runs"].append(result.summary())
        except Exception as e:  # noqa: BLE001 (a peer that fails leaves the others' figures)
            out["errors"].append({"system": system, "workload": name, "error": f"{type(e).__name__}: {e}",
                                  "traceback": _tail(e)})
    tput = {(r["system"], r["workload"]): r.get("output_tokens_per_s") for r in out["runs"]}
    out["ratios"] = {f"{w}: engine / {peer}": tput[("pagedq", w)] / tput[(peer, w)]
                     for w in sets for peer in ("hf-static", "hf-cb")
                     if tput.get(("pagedq", w)) and tput.get((peer, w))}
    out["status"] = "failed" if out["errors"] else "partial" if out.get("stopped") else "ok"
    return out
