"""The in-process systems: the pagedq engine, and the three transformers peers it is measured against.

Every system gets the workload's token ids, greedy decoding, and must produce exactly each request's
max_tokens (ignore_eos). Each returns a Run of per-request Outcomes; nothing is timed outside the work itself.
"""

from __future__ import annotations

import math
import time
import uuid

import torch
from tqdm import tqdm

from bench.result import Outcome, Run, tpot
from bench.workloads import Workload

ENGINE = "pagedq"
REDIS = "pagedq-redis"
HF_SINGLE = "hf-generate"
HF_STATIC = "hf-static"
HF_CB = "hf-cb"
SERVE = "pagedq-serve"
VLLM = "vllm"  # a subprocess in the user's own vLLM environment (bench.vllm_peer)
LLAMACPP = "llamacpp"  # llama.cpp's own llama-server on the model's GGUF (bench.llamacpp_peer)
ALL = (ENGINE, REDIS, HF_SINGLE, HF_STATIC, HF_CB, SERVE, VLLM, LLAMACPP)
DEFAULT = tuple(s for s in ALL if s not in (VLLM, LLAMACPP))  # the peers run when asked for: installs of their own
LABELS = {
    ENGINE: "pagedq engine",
    REDIS: "pagedq via Redis",
    SERVE: "via pagedq serve",
    HF_SINGLE: "HF generate, 1 at a time",
    HF_STATIC: "HF static batching",
    HF_CB: "HF generate_batch (CB)",
    VLLM: "vLLM",
    LLAMACPP: "llama.cpp server",
}


def bar(total: int, desc: str, show: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="req", disable=not show, leave=False, dynamic_ncols=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# ---- pagedq engine, in process ---------------------------------------------------------------------------


def run_engine(engine, wl: Workload, progress: bool = True) -> Run:
    """All requests at once, or at the workload's arrival times (online); stepped until all finish."""
    from engine import SamplingParams

    tag = uuid.uuid4().hex[:6]  # request ids stay unique across runs on one engine
    n = len(wl.requests)
    arrivals = wl.arrivals or [0.0] * n
    order = sorted(range(n), key=lambda i: arrivals[i])
    rid = {f"{tag}-{i}": i for i in range(n)}
    arrived: dict[int, float] = {}
    first: dict[int, float] = {}
    done: dict[int, tuple[float, object]] = {}
    nxt = 0
    with bar(n, f"{wl.name}: {ENGINE}", progress) as pb:
        t0 = time.perf_counter()
        while len(done) < n:
            now = time.perf_counter()
            while nxt < n and t0 + arrivals[order[nxt]] <= now:
                i = order[nxt]
                r = wl.requests[i]
                params = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
                engine.add_request(f"{tag}-{i}", prompt_token_ids=list(r.prompt_ids), params=params)
                arrived[i] = t0 + arrivals[i]
                nxt += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, t0 + arrivals[order[nxt]] - time.perf_counter()))
                continue
            outs = engine.step()
            t = time.perf_counter()
            for o in outs:
                i = rid[o.request_id]
                first.setdefault(i, t)
                if o.finished:
                    done[i] = (t, o)
                    pb.update(1)
        elapsed = time.perf_counter() - t0
    outcomes = []
    for i, r in enumerate(wl.requests):
        t_end, o = done[i]
        n_out = len(o.token_ids)
        err = None if o.finish_reason == "length" else f"finish_reason {o.finish_reason}"
        outcomes.append(Outcome(r.id, len(r.prompt_ids), r.max_tokens, n_out, first[i] - arrived[i],
                                tpot(first[i], t_end, n_out), err, o.num_cached_tokens))
    return Run(ENGINE, wl.name, outcomes, elapsed)


# ---- transformers peers ----------------------------------------------------------------------------------


def load_hf(folder, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device)
    return model.eval()


def _gen_kwargs(model, n: int) -> dict:
    # min_new_tokens masks EOS until n tokens exist: transformers' way of ignore_eos.
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    return {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False, "pad_token_id": pad,
            "temperature": None, "top_p": None, "top_k": None}


@torch.no_grad()
def run_hf_single(model, wl: Workload, limit: int | None, progress: bool = True) -> Run:
    """The usual baseline: `generate` on one request at a time. Slow, so it may run on the first `limit`."""
    reqs = wl.requests[:limit] if limit else wl.requests
    dev = str(model.device)
    outcomes = []
    elapsed = 0.0
    with bar(len(reqs), f"{wl.name}: {HF_SINGLE}", progress) as pb:
        for r in reqs:
            ids = torch.tensor([r.prompt_ids], device=model.device)
            t = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **_gen_kwargs(model, r.max_tokens))
            sync(dev)
            elapsed += time.perf_counter() - t
            outcomes.append(Outcome(r.id, len(r.prompt_ids), r.max_tokens, out.shape[1] - ids.shape[1]))
            pb.update(1)
    return Run(HF_SINGLE, wl.name, outcomes, elapsed, subset=len(reqs) < len(wl.requests),
               note=f"first {len(reqs)} of {len(wl.requests)} requests" if len(reqs) < len(wl.requests) else "")


@torch.no_grad()
def run_hf_static(model, wl: Workload, batch_size: int, progress: bool = True) -> Run:
    """Padded batches of `batch_size` in arrival order; each batch runs until its longest request is done."""
    dev = str(model.device)
    kw0 = _gen_kwargs(model, 1)
    pad = kw0["pad_token_id"]
    outcomes = []
    computed = 0  # output positions computed, wasted ones included
    with bar(len(wl.requests), f"{wl.name}: {HF_STATIC}", progress) as pb:
        t0 = time.perf_counter()
        for s in range(0, len(wl.requests), batch_size):
            batch = wl.requests[s:s + batch_size]
            width = max(len(r.prompt_ids) for r in batch)
            ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch],
                               device=model.device)
            mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch],
                                device=model.device)
            longest = max(r.max_tokens for r in batch)
            out = model.generate(input_ids=ids, attention_mask=mask, **_gen_kwargs(model, longest))
            sync(dev)
            gen = out.shape[1] - width  # every row runs to the batch's longest request
            computed += gen * len(batch)
            # A row's own output is its first max_tokens generated ids; the rest is wasted work.
            outcomes += [Outcome(r.id, len(r.prompt_ids), r.max_tokens, min(gen, r.max_tokens)) for r in batch]
            pb.update(len(batch))
        elapsed = time.perf_counter() - t0
    useful = sum(o.produced for o in outcomes)
    return Run(HF_STATIC, wl.name, outcomes, elapsed,
               extra={"padded_output_positions": computed, "useful_fraction": useful / max(computed, 1)})


@torch.no_grad()
def run_hf_cb(model, wl: Workload, max_num_seqs: int, max_num_batched_tokens: int, progress: bool = True) -> Run:
    """transformers' continuous batching: the manager under `model.generate_batch`, driven directly because
    generate_batch takes one max_new_tokens for all requests and a workload may mix lengths."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    page = 256  # transformers' default page size
    longest = max(len(r.prompt_ids) + r.max_tokens for r in wl.requests)
    slots = min(max_num_seqs, len(wl.requests))
    # The same KV room as pagedq gets: every running sequence at its longest, plus a partial page each.
    cb = ContinuousBatchingConfig(num_blocks=slots * math.ceil(longest / page) + slots,
                                  max_batch_tokens=max_num_batched_tokens, max_requests_per_batch=max_num_seqs)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=_gen_kwargs(model, 1)["pad_token_id"])
    outcomes: dict[str, tuple] = {}
    ids = {}
    with bar(len(wl.requests), f"{wl.name}: {HF_CB}", progress) as pb, \
            model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                      warmup=str(model.device).startswith("cuda")) as mgr:
        t0 = time.perf_counter()
        for r in wl.requests:
            # eos -1: never stops early (ignore_eos)
            ids[mgr.add_request(list(r.prompt_ids), max_new_tokens=r.max_tokens, eos_token_id=-1,
                                record_timestamps=True)] = r
        while len(outcomes) < len(ids):
            res = mgr.get_result(timeout=1)
            if res is None:
                if not mgr.is_running():
                    break
                continue
            if res.is_finished() and res.request_id in ids:
                outcomes[res.request_id] = (time.perf_counter(), res)
                pb.update(1)
        elapsed = time.perf_counter() - t0
    out = []
    for req_id, r in ids.items():
        if req_id not in outcomes:
            out.append(Outcome(r.id, len(r.prompt_ids), r.max_tokens, 0, error="no result"))
            continue
        _, res = outcomes[req_id]
        stamps = res.timestamps or []
        n = len(res.generated_tokens)
        out.append(Outcome(r.id, len(r.prompt_ids), r.max_tokens, n, stamps[0] - t0 if stamps else None,
                           tpot(stamps[0], stamps[-1], n) if stamps else None, res.error))
    return Run(HF_CB, wl.name, out, elapsed)
