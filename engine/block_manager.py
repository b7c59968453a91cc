"""Paged KV memory: fixed-size blocks, a free list, per-sequence block tables, reference counts, prefix cache.

A full block is identified by a hash of its tokens chained with the hash of the block before it, so two
sequences that share a prefix share its blocks. A freed block keeps its hash until it is handed out again:
the least recently freed one goes first, which keeps popular prefixes cached.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.block_tables import BlockTables
from engine.sequence import PLACEHOLDER, Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.tables = BlockTables()
        # Blocks copied on write since the last step took them: (source, destination), for the runner to copy on
        # the device before the step's forward writes anything.
        self.copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:
            if self.cached.get(old) == block:
                del self.cached[old]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        out, prev = [], 0
        bs = self.block_size
        for i in range(num_blocks):
            prev = hash((prev, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
            out.append(prev)
        return out

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq. The last token is never served from cache: it must be computed."""
        if not self.prefix_caching:
            return []
        hits = []
        for h in self._hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int], reserve: int = 0) -> bool:
        """Whether seq can be admitted with `reserve` blocks left over for the running ones to grow into."""
        need = self.blocks_needed(len(hits) * self.block_size + num_new_tokens) - len(hits)
        reclaimed = sum(1 for b in hits if self.ref_counts[b] == 0)  # hits sitting in the free list
        return self.num_free_blocks - reclaimed >= need + reserve

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int]) -> None:
        """First admission (or re-admission after preemption): take the prefix hits, then fresh blocks."""
        assert not seq.block_table
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
        seq.block_table = list(hits)
        seq.table_row = self.tables.take_row()
        self.tables.write(seq.table_row, 0, hits)
        seq.block_hashes = [self.block_hash[b] for b in hits]
        seq.num_computed_tokens = len(hits) * self.block_size
        self.append(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return self.num_free_blocks >= need

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > 0:
            new = [self._take() for _ in range(need)]
            self.tables.write(seq.table_row, len(seq.block_table), new)
            seq.block_table.extend(new)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the blocks that num_tokens of seq fill, free the rest (those only rejected draft tokens wrote). They
        go to the front of the free list: they hold nothing worth caching, and prefixes that do stay longer."""
        keep = self.blocks_needed(num_tokens)
        extra = seq.block_table[keep:]
        if not extra:
            return
        for block in reversed(extra):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
                self.free.move_to_end(block, last=False)
        del seq.block_table[keep:]

    def share(self, parent: Sequence, child: Sequence) -> None:
        """child (a fork of parent) holds every block parent holds, the partly filled last one included."""
        for block in parent.block_table:
            self.ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.table_row = self.tables.take_row()
        self.tables.write(child.table_row, 0, child.block_table)

    def shared_write(self, seq: Sequence) -> bool:
        """Whether seq's next token goes into a block it shares (a fork's): that block must be copied first."""
        i = seq.num_computed_tokens // self.block_size
        return i < len(seq.block_table) and self.ref_counts[seq.block_table[i]] > 1

    def blocks_to_write(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks that writing num_new_tokens more of seq takes: new ones, and a copy of a shared one."""
        grow = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return max(0, grow) + self.shared_write(seq)

    def prepare_write(self, seq: Sequence, num_new_tokens: int) -> None:
        """Blocks for num_new_tokens more of seq: the block it writes into copied first if it shares it (the copy is
        queued in `copies`), then new ones. The caller checked blocks_to_write against the free blocks."""
        if self.shared_write(seq):
            i = seq.num_computed_tokens // self.block_size
            old, new = seq.block_table[i], self._take()
            self.ref_counts[old] -= 1
            self.copies.append((old, new))
            seq.block_table[i] = new
            self.tables.write(seq.table_row, i, [new])
        self.append(seq, num_new_tokens)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def commit(self, seq: Sequence) -> None:
        """After a forward: register the blocks that the computed tokens have filled, so others can share them.
        A block that still holds a PLACEHOLDER (a token on its way from the device) waits for a later commit."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            if PLACEHOLDER in tokens:
                return
            prev = seq.block_hashes[-1] if seq.block_hashes else 0
            h = hash((prev, tokens))
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if self.block_hash[block] is None:
                self.block_hash[block] = h
                self.cached.setdefault(h, block)

    def free_seq(self, seq: Sequence) -> None:
        # Later blocks first, so that a prefix outlives its tails in the eviction order.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        if seq.table_row >= 0:
            self.tables.give_row(seq.table_row)
            seq.table_row = -1
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
