"""The host-side inputs of one forward, built with numpy over the whole batch rather than per token in Python."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from engine.scheduler import SchedulerOutput
from engine.sequence import PLACEHOLDER


@dataclass
class Feed:
    """Batch rows whose input token is still on the device (sampled by the step in flight, overlapped steps):
    tokens[sources[i]] is the input of rows[i]. rows None: every row, tokens[i] the input of row i."""

    rows: np.ndarray | None
    tokens: torch.Tensor
    sources: np.ndarray | None

    @property
    def every_row(self) -> bool:
        return self.rows is None


@dataclass
class StepInputs:
    input_ids: np.ndarray  # int64 [T]: the new tokens of every sequence, back to back
    positions: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [T]: cache slot of each new token
    query_start_loc: np.ndarray  # int32 [B + 1]
    seq_lens: np.ndarray  # int32 [B]: tokens in the cache after this step, the new ones included
    block_table: np.ndarray  # int32 [B, W]
    sample_rows: np.ndarray  # int64: the token rows whose logits are sampled (a sequence's last token)
    table_rows: np.ndarray  # int64 [B]: each sequence's row in the block-table array

    @property
    def decode_only(self) -> bool:
        return len(self.input_ids) == len(self.seq_lens)


def build(batch: SchedulerOutput, tables: np.ndarray, block_size: int, after: StepInputs | None = None,
          fed: bool = False) -> StepInputs:
    """`tables`: the block-table array (BlockManager.tables.array) whose rows the batch's sequences hold.
    after: the previous step's inputs, when both steps decode the same sequences in the same order (the steady
    state): positions and table rows then come from it, one token further, without reading every sequence.
    fed: the input ids come from the device (Feed), so they are not read from the sequences."""
    if after is not None:
        return _next_decode(batch, tables, block_size, after, fed)
    seqs = batch.seqs
    b = len(seqs)
    n = np.array(batch.num_new_tokens, dtype=np.int64)
    start = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, b)
    rows = np.fromiter((s.table_row for s in seqs), np.int64, b)
    end = start + n
    qsl = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(n, out=qsl[1:])
    table = tables[rows, : -(-int(end.max()) // block_size)]
    if int(qsl[-1]) == b:  # one new token each: decode (the common, hot case), and each samples
        ids = np.fromiter((s.token_ids[-1] for s in seqs), np.int64, b)
        positions = start
        token_rows = sample_rows = np.arange(b)
    else:
        ids = np.fromiter(chain.from_iterable(s.token_ids[a : a + k] for s, a, k in
                                              zip(seqs, start.tolist(), n.tolist())), np.int64, int(qsl[-1]))
        token_rows = np.repeat(np.arange(b), n)
        positions = np.arange(int(qsl[-1]), dtype=np.int64) - np.repeat(qsl[:-1] - start, n)
        total = np.fromiter((s.num_tokens for s in seqs), np.int64, b)
        sample_rows = _sample_rows(qsl, end == total, batch.num_drafts)
    slots = _slots(table, token_rows, positions, block_size)
    return StepInputs(ids, positions, slots, qsl, end.astype(np.int32), table, sample_rows, rows)


def _next_decode(batch: SchedulerOutput, tables: np.ndarray, block_size: int, after: StepInputs,
                 fed: bool) -> StepInputs:
    seqs = batch.seqs
    b = len(seqs)
    positions = after.positions + 1
    seq_lens = after.seq_lens + 1
    table = tables[after.table_rows, : -(-int(seq_lens.max()) // block_size)]
    token_rows = np.arange(b)
    ids = np.full(b, PLACEHOLDER, np.int64) if fed else np.fromiter((s.token_ids[-1] for s in seqs), np.int64, b)
    slots = _slots(table, token_rows, positions, block_size)
    return StepInputs(ids, positions, slots, after.query_start_loc, seq_lens, table, token_rows, after.table_rows)


def _sample_rows(qsl: np.ndarray, samples: np.ndarray, num_drafts: list[int]) -> np.ndarray:
    """The token rows sampled: each sampling sequence's last, and with draft tokens (the verify step) the rows of
    its last input token and of every draft, in order."""
    last = qsl[1:] - 1
    if not num_drafts:
        return last[samples]
    counts = np.where(samples, np.asarray(num_drafts, dtype=np.int64) + 1, 0)
    first = np.repeat(last - counts + 1, counts)
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return first + within


def _slots(table: np.ndarray, token_rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slot of each new token: its block (from its row's table) * block_size + its offset there."""
    return table[token_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
