"""Token selection for a batch of rows, vectorized over the batch.

Each row's random draw comes from a generator seeded by (request seed, output position) alone, so a seeded
request samples the same tokens whatever shares its batch, after a preemption, or resumed on another worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from engine.runner.staging import Staging
from engine.sampling_params import SamplingParams
from pagedq_kernels import torch_ops

Argmax = Callable[[torch.Tensor], torch.Tensor]
# Below this a temperature is greedy in all but name, and logits / temperature can leave float32 (inf, then NaN
# probabilities): sampled at this one instead, as vLLM does.
MIN_TEMPERATURE = 1e-2


@dataclass
class SamplingBatch:
    params: list[SamplingParams]
    seeds: list[int]
    steps: list[int]  # output position of the token each row samples
    # Only filled when a penalty or min_tokens needs them.
    output_ids: list[list[int]] | None = None
    prompt_ids: list[list[int]] | None = None
    eos_ids: list[int] | None = None
    greedy_only: bool = False  # every row plain greedy: an argmax, nothing else
    # Beam groups among the rows: (their rows, best first, each beam's score, candidates to keep): their K best
    # continuations are ranked on the device (engine.beam_search takes it from there).
    beams: list[tuple[list[int], list[float], int]] = field(default_factory=list)
    # Rows under a constraint (engine.structured.grammars) and their allowed tokens as a bitmask [rows, words]:
    # every other token's logit is -inf before anything else looks at the logits.
    allowed: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def greedy(cls) -> SamplingBatch:
        return cls(params=[], seeds=[], steps=[], greedy_only=True)


def _mix(seed: int, step: int) -> int:
    # splitmix64 over (seed, step): nearby seeds and steps give unrelated streams.
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch, stage: Staging) -> torch.Tensor:
    rows = [i for i, p in enumerate(batch.params) if p.uses_history]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    # Every penalized row's history in one staged copy each (no per-row tensor from the host, no data-dependent
    # shape: both would make the host wait on a GPU); a row's counts are a scatter of ones.
    outputs = [batch.output_ids[i] for i in rows]
    prompts = [[t for t in batch.prompt_ids[i] if t < vocab] for i in rows]
    out_ids = stage.to_device("penalty_outputs", np.fromiter(chain.from_iterable(outputs), np.int64))
    prompt_ids = stage.to_device("penalty_prompts", np.fromiter(chain.from_iterable(prompts), np.int64))
    out_at, prompt_at = np.cumsum([0, *map(len, outputs)]).tolist(), np.cumsum([0, *map(len, prompts)]).tolist()
    for r, i in enumerate(rows):  # rows with penalties are rare; their token histories differ in length anyway
        p = batch.params[i]
        out = out_ids[out_at[r]: out_at[r + 1]]
        counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(0, out, torch.ones(out.shape, dtype=logits.dtype, device=logits.device))
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[prompt_ids[prompt_at[r]: prompt_at[r + 1]]] = True
            row = logits[i]
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            logits[i] = torch.where(seen, penalized, row)
        if p.frequency_penalty:
            logits[i] -= p.frequency_penalty * counts
        if p.presence_penalty:
            logits[i] -= p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_allowed(logits: torch.Tensor, rows: np.ndarray, bits: np.ndarray, stage: Staging) -> None:
    """logits[rows[i], t] = -inf (in place) wherever bit t of bits[i] is clear. Only the constrained rows are
    touched. On a GPU the bits go over packed (1/32 of the logits) and are unpacked there."""
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":  # unpacked to bytes 0 and 1: booleans as they are
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(unpacked).view(torch.bool)[:, :vocab]
    else:
        packed = stage.to_device("allowed_bits", bits)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((packed[:, :, None] >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    banned = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    if len(rows) == logits.shape[0]:  # rows are in order, none twice: every row
        torch.where(allowed, logits, banned, out=logits)
    elif logits.device.type == "cpu":
        for i, row in enumerate(rows.tolist()):  # views: each row masked where it lies, nothing copied
            torch.where(allowed[i], logits[row], banned, out=logits[row])
    else:  # one gather and one scatter rather than a launch per row
        at = stage.to_device("allowed_rows", rows)
        logits.index_copy_(0, at, torch.where(allowed, logits.index_select(0, at), banned))


def apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch, stage: Staging) -> torch.Tensor:
    banned = [(i, t) for i in range(len(batch.params)) for t in _banned(batch, i)]
    if banned:
        at = stage.to_device("min_tokens", np.array(banned, dtype=np.int64).T.copy())
        logits[at[0], at[1]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, batch: SamplingBatch, argmax: Argmax = torch_ops.argmax, stage: Staging | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """logits [S, V] in the model's dtype -> (token ids [S], logprobs of the raw distribution [S, V] or empty, each
    beam group's K best candidates as (accumulated logprobs, beam * V + token), best first). Everything but a plain
    argmax runs in float32. `argmax`: each row's first maximum (a backend's kernel). `stage`: how per-row settings
    reach the device (the runner's, whose copies never make the host wait)."""
    stage = stage or Staging(logits.device)
    if batch.allowed is not None:
        apply_allowed(logits, *batch.allowed, stage)
    if batch.greedy_only:  # float32 holds every bfloat16 / float16 value exactly: the same first maximum, no copy
        return argmax(logits), torch.empty(0), []
    logits = logits.float()
    want_logprobs = any(p.needs_logprobs for p in batch.params)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else torch.empty(0)
    candidates = _beam_candidates(logits, batch, stage)
    logits = apply_min_tokens(apply_penalties(logits, batch, stage), batch, stage)
    greedy = argmax(logits)
    random_rows = [i for i, p in enumerate(batch.params) if p.temperature > 0]
    if not random_rows:
        return greedy, raw_logprobs, candidates
    params = [batch.params[i] for i in random_rows]
    rows = stage.to_device("random_rows", np.array(random_rows, dtype=np.int64))
    temperatures = [max(p.temperature, MIN_TEMPERATURE) for p in params]
    x = logits[rows] / _per_row(stage, "temperature", temperatures)[:, None]
    if any(p.top_k for p in params) or any(p.top_p < 1 for p in params):
        x = _top_k_top_p(x, params, stage)
    probs = torch.softmax(x, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = _per_row(stage, "min_p", [p.min_p for p in params])[:, None]
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    # Exponential race: argmax(p / E), E ~ Exp(1), picks token t with probability p_t.
    noise = torch.empty_like(probs)
    gen = torch.Generator(device=logits.device)
    for j, i in enumerate(random_rows):
        gen.manual_seed(_mix(batch.seeds[i], batch.steps[i]))
        noise[j].exponential_(generator=gen)
    chosen = argmax(probs / noise)
    greedy[rows] = chosen
    return greedy, raw_logprobs, candidates


def _beam_candidates(logits: torch.Tensor, batch: SamplingBatch, stage: Staging
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per beam group: the K best of (beam score + the token's logprob) over its beams' vocabularies, as transformers'
    beam search ranks them: log_softmax of the raw logits, then min_tokens' bans (-inf) on the logprobs."""
    found = []
    for g, (rows, scores, k) in enumerate(batch.beams):
        lp = torch.log_softmax(logits[stage.to_device(f"beam_rows{g}", np.array(rows, dtype=np.int64))], dim=-1)
        banned = [(r, t) for r, row in enumerate(rows) for t in _banned(batch, row)]
        if banned:
            at = stage.to_device(f"beam_banned{g}", np.array(banned, dtype=np.int64).T.copy())
            lp[at[0], at[1]] = float("-inf")
        acc = lp + _per_row(stage, f"beam_scores{g}", scores)[:, None]
        found.append(acc.reshape(-1).topk(min(k, acc.numel())))  # many stop tokens on a small vocabulary
    return found


def _banned(batch: SamplingBatch, i: int) -> list[int]:
    """Tokens row i may not pick yet: its stop tokens and EOS, until it has min_tokens."""
    p = batch.params[i]
    if not (p.min_tokens and batch.steps[i] < p.min_tokens):
        return []
    return [*p.stop_token_ids, *([] if p.ignore_eos else batch.eos_ids or [])]


def _per_row(stage: Staging, name: str, values: list[float]) -> torch.Tensor:
    """A float32 setting per row on the device (float32, as torch.tensor makes Python floats)."""
    return stage.to_device(name, np.array(values, dtype=np.float32))


def _top_k_top_p(x: torch.Tensor, params: list[SamplingParams], stage: Staging) -> torch.Tensor:
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    top_k = stage.to_device("top_k", np.array([p.top_k if p.top_k else vocab for p in params], dtype=np.int64))
    ranks = torch.arange(vocab, device=x.device)[None, :]
    drop = ranks >= top_k[:, None]
    top_p = _per_row(stage, "top_p", [p.top_p for p in params])
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the first token is always kept.
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p[:, None]
    drop[:, 0] = False  # also where top_p rounds to 0 in float32
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)
