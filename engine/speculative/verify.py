"""The verify step's bookkeeping: draft tokens attached to a step's decode rows, and what lands of them.

A decoding sequence computes one token a step: its last. With k draft tokens it computes k + 1 (its last and the
drafts, one query of k + 1 tokens, as a prefill chunk is), and a token is drawn at each of them exactly as decoding
without drafts would draw it there: greedy, the argmax; sampling, the draw its seed and output position fix
(engine.runner.sampler). The drafts agreeing with those tokens are accepted, and the token after the last accepted
one comes free: 1 to k + 1 tokens a step, each the token decoding without speculation gives. For a proposer whose
draft is one guess (a point mass), this is speculative rejection sampling's own rule: a draft x is kept with the
target's probability p(x), and where it is not, the token landed is the target's draw given that it is not x, so the
output's distribution is the target's; a seeded request gets the very same tokens, wherever it runs or resumes.
The KV written for a rejected draft is simply not counted as computed; blocks that only rejected drafts wrote are
freed when the step lands (BlockManager.trim). How many drafts a sequence gets is the policy's (policy.py).

Speculation is off for a request that asks so (SamplingParams.speculative), for a sequence in a group (n > 1, best_of, beams: their continuations fork and step together)
and for one with a constraint.
"""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative.policy import Policy
from engine.speculative.proposer import Proposer
from engine.stats import SpeculationCounts


def speculates(seq: Sequence) -> bool:
    """Whether seq may carry draft tokens: see the module's docstring."""
    return seq.params.speculative and seq.group is None  # a constraint's drafts: speculative.constrained


def accepted(draft: list[int], targets: list[int]) -> list[int]:
    """The tokens a verified draft lands: its prefix that agrees with the target's argmaxes (targets[i] is the
    target's token where draft[i] was proposed; one more at the end), then the target's next token."""
    j = 0
    while j < len(draft) and draft[j] == targets[j]:
        j += 1
    return [*draft[:j], targets[j]]


class Speculator:
    def __init__(self, proposer: Proposer, policy: Policy, bm: BlockManager, max_num_batched_tokens: int,
                 watermark: int, counts: SpeculationCounts) -> None:
        self.proposer = proposer
        self.policy = policy
        self.bm = bm
        self.max_tokens = max_num_batched_tokens
        self.watermark = watermark  # free blocks drafts never take: the scheduler keeps them for growth
        self.counts = counts

    def attach(self, batch: SchedulerOutput) -> dict[Sequence, list[int]]:
        """Draft tokens for the batch's greedy decode rows, within its token budget and the free blocks: each
        sequence's drafts appended to its token_ids (inputs of the step), its row's token count raised and its
        blocks grown -> the drafts by sequence (empty: none this step)."""
        wants = self._wants(batch)
        if not wants:
            return {}
        proposals = self.proposer.propose([(batch.seqs[i], k) for i, k in wants])
        drafts: dict[Sequence, list[int]] = {}
        counts = [0] * len(batch.seqs)
        for (i, k), draft in zip(wants, proposals):
            seq = batch.seqs[i]
            draft = draft[: min(k, self._room(seq))]
            if not draft:
                continue
            self.bm.append(seq, 1 + len(draft))
            seq.token_ids.extend(draft)
            batch.num_new_tokens[i] += len(draft)
            counts[i] = len(draft)
            drafts[seq] = draft
        if drafts:
            batch.num_drafts = counts
            self.counts.steps += 1
        return drafts

    def _wants(self, batch: SchedulerOutput) -> list[tuple[int, int]]:
        """(row, most draft tokens) for each of the batch's rows that speculates this step: the policy's share,
        within the step's token budget."""
        rows, limits = [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if n != 1 or seq.num_computed_tokens + 1 != len(seq.token_ids) or not speculates(seq):
                continue
            # Every landed token stays below max_len: the last one a step may land is at max_len - 1.
            limit = seq.max_len - len(seq.token_ids) - 1
            if limit > 0:
                rows.append(i)
                limits.append(limit)
        if not rows:
            return []
        samplers = sum(1 for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.num_computed_tokens + n ==
                       len(seq.token_ids))
        ks = self.policy.plan([batch.seqs[i] for i in rows], limits, batch.num_tokens, samplers)
        budget = self.max_tokens - batch.num_tokens
        wants = []
        for i, k in zip(rows, ks):
            k = min(k, budget)
            if k > 0:
                wants.append((i, k))
                budget -= k
        return wants

    def _room(self, seq: Sequence) -> int:
        """Draft tokens seq's blocks, and the free ones above the watermark, hold after its last token."""
        bm = self.bm
        spare = max(0, bm.num_free_blocks - self.watermark)
        return (len(seq.block_table) + spare) * bm.block_size - seq.num_computed_tokens - 1

    def strip(self, batch: SchedulerOutput, drafts: dict[Sequence, list[int]]) -> None:
        """After the forward read them: drafts out of their sequences' tokens and rows again (what lands of them
        comes back as landed tokens). Their KV stays, in blocks kept until the step lands."""
        for i, seq in enumerate(batch.seqs):
            draft = drafts.get(seq)
            if draft:
                del seq.token_ids[-len(draft):]
                batch.num_new_tokens[i] -= len(draft)

    def undo(self, batch: SchedulerOutput, drafts: dict[Sequence, list[int]]) -> None:
        """Drop the step's drafts before its forward: tokens, rows and the blocks they took, as if never attached."""
        self.strip(batch, drafts)
        for seq in drafts:
            self.bm.trim(seq, seq.num_computed_tokens + 1)
        batch.num_drafts = []
        self.counts.steps -= 1

    def settle(self, seq: Sequence, draft: list[int], targets: list[int]) -> list[int]:
        """A drafted sequence's step landed -> the tokens it lands. The accepted drafts' KV counts as computed."""
        tokens = accepted(draft, targets)
        seq.num_computed_tokens += len(tokens) - 1
        self.policy.record(seq, len(draft), len(tokens) - 1)
        self.counts.proposed += len(draft)
        self.counts.accepted += len(tokens) - 1
        return tokens

    def finished(self, seq: Sequence) -> None:
        """seq left the engine: the proposer drops what it keeps for it (Scheduler.on_finish)."""
        self.proposer.finished(seq)
        self.policy.forget(seq)

    def keep(self, seq: Sequence, computed: int) -> None:
        """After seq's landed tokens are written in, the first `computed` of its tokens computed (fewer than settle
        counted where a landed token ended it): share the blocks they filled, free those beyond them."""
        seq.num_computed_tokens = computed
        self.bm.commit(seq)
        self.bm.trim(seq, computed)
