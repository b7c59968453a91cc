"""Beam search as transformers' generate(num_beams=B, do_sample=False) runs it, one request at a time, on the host.

Each step the device gives, over all live beams' next tokens, the K best of (beam's score + the token's logprob),
K = max(2, 1 + stop tokens) * B (engine.runner.sampler). This class does the rest with transformers' own arithmetic, in
float32 torch ops over those K, so that the same logits pick the same beams: candidates that end (a stop token,
or the length limit) and rank among the first B go to the finished hypotheses, length-normalized; the B best that
do not end carry on; and the search stops as transformers' does (no open beam can beat the finished ones, all
beams finished with early_stopping=True, or no candidate can go on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NEG = -1.0e9  # transformers' score for "not a candidate"


def length_norm(length: int, penalty: float) -> float:
    """length ** penalty, saturating at infinity where a float cannot hold it (a long beam, a large penalty): the
    score it divides then goes to 0 instead of the step raising OverflowError."""
    try:
        return float(length) ** penalty
    except OverflowError:
        return math.inf


def _normalized(logprob: float, length: int, penalty: float) -> float:
    """A beam's score: its logprob over length ** penalty (-inf where that is 0: the beam is hopeless)."""
    norm = length_norm(length, penalty)
    return logprob / norm if norm else -math.inf


@dataclass
class Hypothesis:
    token_ids: list[int]  # the whole sequence, prompt included
    score: float  # logprob sum over length ** length_penalty: what beams are ranked by
    logprob: float  # the plain sum of its tokens' logprobs
    stopped: bool  # ended by a stop token (else by the length limit)


@dataclass
class Continuation:
    beam: int  # index of the beam it continues
    token: int
    score: float  # the beam's score after it (transformers' running beam score)


class BeamSearch:
    def __init__(self, width: int, prompt_len: int, max_len: int, stop_ids: frozenset[int], length_penalty: float,
                 early_stopping: bool | str) -> None:
        self.width = width
        self.prompt_len = prompt_len
        self.max_len = max_len
        self.stop_ids = stop_ids
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.candidates = max(2, 1 + len(stop_ids)) * width
        self.scores = [0.0]  # the live beams', best first; at first the prompt alone
        self.finished_scores = torch.full((width,), NEG)
        self.finished: list[Hypothesis | None] = [None] * width
        self.finished_flags = torch.zeros(width, dtype=torch.bool)
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.unfinished: list[Hypothesis] = []  # the open beams when the search ended, best first

    def step(self, values: list[float], indices: list[int], beams: list[list[int]], vocab: int
             ) -> tuple[list[Continuation], bool]:
        """One step: the K candidates (accumulated logprobs, flat indices beam * vocab + token, best first) over
        `beams` (each live beam's token ids, all of one length) -> the beams that carry on, and whether the search
        is over."""
        cur_len = len(beams[0])
        topk = torch.tensor(values, dtype=torch.float32)
        beam_of = [i // vocab for i in indices]
        tokens = [i % vocab for i in indices]
        hits = torch.tensor([t in self.stop_ids or cur_len + 1 >= self.max_len for t in tokens])
        running = topk + hits.to(torch.float32) * NEG
        keep = torch.topk(running, k=min(self.width, len(values)))[1].tolist()
        carry = [Continuation(beam_of[j], tokens[j], float(running[j])) for j in keep]
        self._finish(topk, hits, beam_of, tokens, beams, cur_len)
        self.scores = [c.score for c in carry]
        self._update_improvable(cur_len + 1)
        exists_open = not (bool(self.finished_flags.all()) and self.early_stopping is True)
        over = not (self.improvable and exists_open and not bool(hits.all()))
        if over:
            length = cur_len + 1 - self.prompt_len
            self.unfinished = [Hypothesis(beams[c.beam] + [c.token], _normalized(c.score, length, self.length_penalty),
                                          c.score, False) for c in carry]
        return carry, over

    def _finish(self, topk: torch.Tensor, hits: torch.Tensor, beam_of: list[int], tokens: list[int],
                beams: list[list[int]], cur_len: int) -> None:
        """Candidates among the first `width` that end join the finished hypotheses if they rank among the best."""
        just = hits & (torch.arange(len(tokens)) < self.width)
        scores = topk / length_norm(cur_len + 1 - self.prompt_len, self.length_penalty)
        full = bool(self.finished_flags.all()) and self.early_stopping is True
        scores += float(full) * NEG
        scores += float(not self.improvable) * NEG
        scores += (~just).to(torch.float32) * NEG
        merged = torch.cat((self.finished_scores, scores))
        top = torch.topk(merged, k=self.width)[1].tolist()
        width = self.width
        flags = torch.cat((self.finished_flags, just))
        entries = [*self.finished, *(Hypothesis(beams[b] + [t], 0.0, float(lp), t in self.stop_ids)
                                     for b, t, lp in zip(beam_of, tokens, topk.tolist()))]
        self.finished = [entries[j] for j in top]
        self.finished_scores = merged[top]
        self.finished_flags = flags[top]
        for j, h in enumerate(self.finished[:width]):
            if h is not None:
                h.score = float(self.finished_scores[j])

    def _update_improvable(self, cur_len: int) -> None:
        """transformers' early-stop heuristic: can the best open beam still beat the worst finished one?"""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_len - self.prompt_len
        else:
            best_len = cur_len - self.prompt_len
        best_running = torch.tensor([self.scores[0]], dtype=torch.float32) / length_norm(best_len, self.length_penalty)
        worst = torch.where(self.finished_flags, self.finished_scores.min(), torch.tensor(NEG))
        self.improvable = self.improvable and bool((best_running > worst).any())

    def results(self, n: int) -> list[Hypothesis]:
        """The n best finished hypotheses, best first. A search that ended with fewer (every open beam hopeless
        under an extreme length_penalty, say) fills up with its best open beams, as if the length limit had ended
        them: a request always gets its n."""
        done = [h for h, flag in zip(self.finished[:n], self.finished_flags[:n].tolist()) if h is not None and flag]
        return done + self.unfinished[: n - len(done)]
