"""The host-side inputs of one forward, built with numpy over the whole batch rather than per token in Python."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from engine.scheduler import SchedulerOutput


@dataclass
class Feed:
    """Batch rows whose input token is still on the device (sampled by the step in flight, overlapped steps):
    tokens[sources[i]] is the input of rows[i]."""

    rows: list[int]
    tokens: torch.Tensor
    sources: list[int]


@dataclass
class StepInputs:
    input_ids: np.ndarray  # int64 [T]: the new tokens of every sequence, back to back
    positions: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [T]: cache slot of each new token
    query_start_loc: np.ndarray  # int32 [B + 1]
    seq_lens: np.ndarray  # int32 [B]: tokens in the cache after this step, the new ones included
    block_table: np.ndarray  # int32 [B, W]
    sample_rows: np.ndarray  # int64: the token rows whose logits are sampled (a sequence's last token)

    @property
    def decode_only(self) -> bool:
        return len(self.input_ids) == len(self.seq_lens)


def build(batch: SchedulerOutput, tables: np.ndarray, block_size: int) -> StepInputs:
    """`tables`: the block-table array (BlockManager.tables.array) whose rows the batch's sequences hold."""
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
        sample_rows = (qsl[1:] - 1)[end == total]
    slots = table[token_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return StepInputs(ids, positions, slots, qsl, end.astype(np.int32), table, sample_rows)
