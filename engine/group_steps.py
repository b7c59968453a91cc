"""What an engine step does for requests with several continuations (engine.group): sampling groups fork when their
prompt is done, beam groups take their beam step when a step lands, and a group that ends reports the
continuations it returns."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.block_manager import BlockManager
from engine.group import Group, child_seed
from engine.outputs import RequestOutput
from engine.scheduler import Scheduler
from engine.sequence import Sequence


class GroupSteps:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager,
                 detokenizer: Callable[[list[int], list[str]], object]) -> None:
        self.scheduler = scheduler
        self.bm = block_manager
        self.detokenizer = detokenizer  # (prompt ids, stop strings) -> a Detokenizer

    def fork(self, samplers: list[Sequence]) -> tuple[list[Sequence], np.ndarray | None]:
        """Sampling groups whose prompt samples for the first time fork now, each continuation sampling from the
        prompt's row of logits with its own seed -> the step's samplers, each group's new continuations right after
        its prompt's, and which of the step's sampled rows each sampler takes (None: its own)."""
        if all(s.group is None for s in samplers):
            return samplers, None
        out, rows = [], []
        for row, seq in enumerate(samplers):
            out.append(seq)
            rows.append(row)
            group = seq.group
            if group is None or group.forked or group.is_beam:
                continue
            children = [self._fork(seq, i) for i in range(1, group.width)]
            group.seqs = [seq, *children]
            group.forked = True
            self.scheduler.forked(seq, children)
            out += children
            rows += [row] * len(children)
        return out, (np.array(rows, dtype=np.int64) if len(out) > len(samplers) else None)

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        child = parent.fork(index, child_seed(parent.seed, index))
        # It samples in the step that computes the prompt's last token: from then on it holds that KV too.
        child.num_computed_tokens = len(child.token_ids)
        self.bm.share(parent, child)
        child.detok = self.detokenizer(child.token_ids[: child.num_prompt_tokens], child.params.stop)
        return child

    def member_finished(self, seq: Sequence) -> list[RequestOutput]:
        """A sampling continuation ended (its blocks are free) -> the group's outputs if that ended the request
        and its continuations were not reported as they came."""
        group = seq.group
        if not group.ended(seq):
            return []
        self.scheduler.forget(group.request_id)
        return self._report(group, [(s, whole_text(s), None) for s in group.returned()])

    def beam_step(self, group: Group, values: list[float], indices: list[int], vocab: int) -> list[RequestOutput]:
        """A beam group's step from its K best candidates -> its outputs when the search is over, else none (its
        beams moved on: kept ones forked, the others dropped)."""
        beams = group.seqs
        carry, done = group.beams.step(values, indices, [b.token_ids for b in beams], vocab)
        if done:
            return self._end_beams(group)
        claims: dict[int, list[int]] = {}
        for j, c in enumerate(carry):
            claims.setdefault(c.beam, []).append(j)
        moved: list[Sequence | None] = [None] * len(carry)
        for b, js in claims.items():  # every fork from its parent as it was, then each takes its token
            parent = beams[b]
            seqs = [parent] + [parent.fork(parent.index, parent.seed) for _ in js[1:]]
            for child in seqs[1:]:
                self.bm.share(parent, child)
            for seq, j in zip(seqs, js):
                seq.token_ids.append(carry[j].token)
                seq.cumulative_logprob = carry[j].score
                moved[j] = seq
        for b, beam in enumerate(beams):
            if b not in claims:
                self.scheduler.drop(beam)
        self.scheduler.replace_beams(beams, moved, first=not group.forked)
        group.seqs, group.forked = moved, True
        return []

    def _end_beams(self, group: Group) -> list[RequestOutput]:
        template = group.seqs[0]
        for beam in group.seqs:
            self.scheduler.drop(beam)
        self.scheduler.forget(group.request_id)
        ended = []
        for i, h in enumerate(group.beams.results(group.n)):
            seq = template.fork(i, template.seed)
            seq.token_ids, seq.finish_reason = h.token_ids, "stop" if h.stopped else "length"
            seq.hidden_stop = h.stopped
            seq.detok = self.detokenizer(seq.token_ids[: seq.num_prompt_tokens], [])
            seq.cumulative_logprob = h.logprob
            ended.append((seq, whole_text(seq), h.score))
        group.seqs = []
        return self._report(group, ended)

    @staticmethod
    def _report(group: Group, ended: list[tuple[Sequence, str, float | None]]) -> list[RequestOutput]:
        """The group's continuations, numbered by rank, each with all its tokens; the last ends the request."""
        outs = []
        for rank, (seq, text, score) in enumerate(ended):
            out = RequestOutput.whole(seq, rank, seq.finish_reason, text)
            out.cumulative_logprob, out.score = seq.cumulative_logprob, score
            out.hidden_stop = seq.hidden_stop
            outs.append(out)
        if outs:
            outs[-1].request_finished = True
            outs[-1].choices = outs
        return outs


def whole_text(seq: Sequence) -> str:
    """A finished continuation's text, for one reported at the end: decoded as it landed where it has stop strings,
    else now, without a last token whose text is not shown (Sequence.hidden_stop, set by engine.finishing)."""
    detok = seq.detok
    if not detok.lazy:
        return detok.text
    ids = seq.token_ids[seq.num_prompt_tokens:]
    if seq.hidden_stop:
        ids = ids[:-1]
    return detok.add(ids, final=True)[0]
