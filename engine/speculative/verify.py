"""The verify step's bookkeeping: draft tokens attached to a step's greedy decode rows, and what lands of them.

A decoding sequence computes one token a step: its last. With k draft tokens it computes k + 1 (its last and the
drafts, one query of k + 1 tokens, as a prefill chunk is), and the target's argmax at each of them is sampled. The
drafts agreeing with those argmaxes are accepted, and the argmax after the last accepted one comes free: 1 to k + 1
tokens a step, each exactly the token greedy decoding gives. The KV written for a rejected draft is simply not
counted as computed; blocks that only rejected drafts wrote are freed when the step lands (BlockManager.trim).

Speculation is off for a sequence that samples (temperature > 0), needs logprobs, penalties or min_tokens (not
plain greedy), belongs to a group (n > 1, best_of, beams) or has a constraint.
"""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative.proposer import Proposer
from engine.stats import SpeculationCounts


def speculates(seq: Sequence) -> bool:
    """Whether seq may carry draft tokens: see the module's docstring."""
    return seq.plain_greedy and seq.group is None  # a constraint's drafts: engine.speculative.constrained


def accepted(draft: list[int], targets: list[int]) -> list[int]:
    """The tokens a verified draft lands: its prefix that agrees with the target's argmaxes (targets[i] is the
    target's token where draft[i] was proposed; one more at the end), then the target's next token."""
    j = 0
    while j < len(draft) and draft[j] == targets[j]:
        j += 1
    return [*draft[:j], targets[j]]


class Speculator:
    def __init__(self, proposer: Proposer, k: int, bm: BlockManager, max_num_batched_tokens: int, watermark: int,
                 counts: SpeculationCounts) -> None:
        self.proposer = proposer
        self.k = k
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
        """(row, most draft tokens) for each of the batch's rows that may speculate this step, within its token
        budget."""
        budget = self.max_tokens - batch.num_tokens
        wants = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if budget <= 0:
                break
            if n != 1 or seq.num_computed_tokens + 1 != len(seq.token_ids) or not speculates(seq):
                continue
            # Every landed token stays below max_len: the last one a step may land is at max_len - 1.
            k = min(self.k, budget, seq.max_len - len(seq.token_ids) - 1)
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
        self.counts.proposed += len(draft)
        self.counts.accepted += len(tokens) - 1
        return tokens

    def finished(self, seq: Sequence) -> None:
        """seq left the engine: the proposer drops what it keeps for it (Scheduler.on_finish)."""
        self.proposer.finished(seq)

    def keep(self, seq: Sequence) -> None:
        """After seq's landed tokens are written in: share the blocks they filled, free those beyond them."""
        self.bm.commit(seq)
        self.bm.trim(seq, seq.num_computed_tokens)
