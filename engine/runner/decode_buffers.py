"""Decode steps through fixed-size, padded input buffers: what a CUDA graph replays, on any device.

A captured graph reads its inputs from the addresses it saw at capture time and runs for one batch size, so a
decode step copies its inputs into static buffers and pads the batch up to the next captured size. Padding rows
must not touch the cache: their slot is -1 (store_kv skips it) and their sequence length 0 (attention reads no
key and gives zeros). Nothing here is CUDA-specific, so the CPU tests run real decode steps through it.
"""

from __future__ import annotations

import bisect

import torch

from engine.models.llama import AttnContext
from engine.runner.staging import Staging
from engine.runner.step_inputs import StepInputs
from pagedq_kernels import Backend


def padded_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, up to max_num_seqs (always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def padded_size(n: int, sizes: list[int]) -> int:
    """The smallest size that holds n rows."""
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"a decode batch of {n} rows is larger than the largest padded size {sizes[-1]}")
    return sizes[i]


class DecodeBuffers:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.sizes = padded_sizes(max_num_seqs)
        self.device = device
        n = max_num_seqs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        # One new token per row, for every size: the prefix [:size + 1] is each size's query_start_loc.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def load(self, inputs: StepInputs, staging: Staging) -> int:
        """Copy a decode step's inputs in (through `staging`: no copy waits) and pad them; -> the padded batch size
        to run."""
        n = len(inputs.input_ids)
        size = padded_size(n, self.sizes)
        staging.copy_into(self.input_ids[:n], "input_ids", inputs.input_ids)
        staging.copy_into(self.positions[:n], "positions", inputs.positions)
        staging.copy_into(self.slot_mapping[:n], "slots", inputs.slots)
        staging.copy_into(self.seq_lens[:n], "seq_lens", inputs.seq_lens)
        # Padding rows: no slot written, no key read. Columns past a row's own blocks keep older entries:
        # attention never reads past seq_lens.
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(0)
        self.input_ids[n:size].fill_(0)
        self.positions[n:size].fill_(0)
        width = inputs.block_table.shape[1]
        staging.copy_into(self.block_table[:n, :width], "block_table", inputs.block_table)
        return size

    def inputs(self, size: int, backend: Backend) -> tuple[torch.Tensor, torch.Tensor, AttnContext]:
        """Views of the first `size` rows: the model's input ids, positions and attention context."""
        ctx = AttnContext(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            backend=backend,
        )
        return self.input_ids[:size], self.positions[:size], ctx
