"""The block tables of every sequence in the KV cache as one persistent int32 array, a row per sequence.

Kept in step with each Sequence's own block_table list as blocks are added, so that a step's table is one
gather of rows, not a padded copy of Python lists (which costs every sequence its whole table, every step).
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, rows: int = 64, cols: int = 64) -> None:
        self.array = np.zeros((rows, cols), dtype=np.int32)
        self.free_rows = list(range(rows - 1, -1, -1))

    def take_row(self) -> int:
        if not self.free_rows:
            old = self.array.shape[0]
            self._grow(2 * old, self.array.shape[1])
            self.free_rows = list(range(2 * old - 1, old - 1, -1))
        return self.free_rows.pop()

    def give_row(self, row: int) -> None:
        self.free_rows.append(row)

    def write(self, row: int, start: int, blocks: list[int]) -> None:
        """Entries [start, start + len(blocks)) of `row`."""
        end = start + len(blocks)
        if end > self.array.shape[1]:
            self._grow(self.array.shape[0], max(end, 2 * self.array.shape[1]))
        self.array[row, start:end] = blocks

    def _grow(self, rows: int, cols: int) -> None:
        bigger = np.zeros((rows, cols), dtype=np.int32)
        bigger[: self.array.shape[0], : self.array.shape[1]] = self.array
        self.array = bigger
