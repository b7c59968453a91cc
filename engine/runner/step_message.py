"""The step message: rank 0 -> every other rank of a tensor-parallel replica, once per step (never per layer).

A fixed header (op and sizes), then one int64 body of the step's host inputs and copied blocks, both broadcast over
the control group (gloo), so the other ranks run the same forward on their shards.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.parallel.shard import Shard
from engine.runner.step_inputs import StepInputs

STOP, STEP = 0, 1
HEADER = 6  # op, tokens, sequences, block-table width, copied blocks, sampled rows


def send_step(shard: Shard, inputs: StepInputs, copies: list[tuple[int, int]] | None) -> None:
    pairs = np.asarray(copies or [], dtype=np.int64).reshape(-1, 2)
    table = inputs.block_table
    header = [STEP, len(inputs.input_ids), len(inputs.seq_lens), table.shape[1], len(pairs), len(inputs.sample_rows)]
    shard.broadcast(torch.tensor(header, dtype=torch.int64))
    body = np.concatenate([inputs.input_ids, inputs.positions, inputs.slots, inputs.query_start_loc,
                           inputs.seq_lens, table.reshape(-1), pairs.reshape(-1), inputs.sample_rows],
                          dtype=np.int64, casting="unsafe")
    shard.broadcast(torch.from_numpy(body))


def send_stop(shard: Shard) -> None:
    shard.broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64))


def recv_step(shard: Shard) -> tuple[StepInputs, list[tuple[int, int]]] | None:
    """The next step's inputs and copied blocks from rank 0; None: stop."""
    header = shard.broadcast(torch.empty(HEADER, dtype=torch.int64)).tolist()
    op, tokens, seqs, width, ncopies, nsample = header
    if op == STOP:
        return None
    sizes = [tokens, tokens, tokens, seqs + 1, seqs, seqs * width, 2 * ncopies, nsample]
    body = shard.broadcast(torch.empty(sum(sizes), dtype=torch.int64)).numpy()
    ids, positions, slots, qsl, seq_lens, table, pairs, sample_rows = np.split(body, np.cumsum(sizes)[:-1])
    inputs = StepInputs(ids, positions, slots, qsl.astype(np.int32), seq_lens.astype(np.int32),
                        table.astype(np.int32).reshape(seqs, width), sample_rows, np.arange(seqs))
    return inputs, [tuple(p) for p in pairs.reshape(-1, 2).tolist()]
