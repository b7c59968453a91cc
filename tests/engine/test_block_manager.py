"""Block manager on its own: allocation, reference counts, prefix sharing, eviction order, no leaks."""

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8))


def test_allocate_append_free_returns_every_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = seq(range(10))
    assert bm.can_allocate(s, 10, [])
    bm.allocate(s, 10, [])
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    s.num_computed_tokens = 10
    s.token_ids += [1, 2, 3]
    bm.append(s, 1)  # token 11 still fits in block 3
    assert len(s.block_table) == 3
    s.num_computed_tokens = 12
    bm.append(s, 1)  # token 13 needs a fourth block
    assert len(s.block_table) == 4 and bm.num_free_blocks == 6
    bm.free_seq(s)
    assert bm.num_free_blocks == 10 and s.block_table == [] and s.num_computed_tokens == 0


def test_can_allocate_refuses_when_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate(seq(range(9)), 9, [])
    assert bm.can_allocate(seq(range(8)), 8, [])


def test_prefix_blocks_are_shared_with_reference_counts():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(12), "a")
    bm.allocate(a, 12, [])
    a.num_computed_tokens = 12
    bm.commit(a)
    b = seq(list(range(8)) + [99, 98, 97], "b")
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    bm.allocate(b, b.num_tokens - 8, hits)
    assert b.num_computed_tokens == 8
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    bm.free_seq(a)
    assert [bm.ref_counts[x] for x in b.block_table[:2]] == [1, 1]
    bm.free_seq(b)
    assert bm.num_free_blocks == 10 and all(r == 0 for r in bm.ref_counts)


def test_last_token_is_never_a_cache_hit():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(range(8), "a")
    bm.allocate(a, 8, [])
    a.num_computed_tokens = 8
    bm.commit(a)
    # The same 8 tokens again: only the first block may be reused, the second holds the token to compute.
    assert len(bm.match_prefix(seq(range(8), "b"))) == 1


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(8), "a")
    bm.allocate(a, 8, [])
    a.num_computed_tokens = 8
    bm.commit(a)
    bm.free_seq(a)
    b = seq(list(range(8)) + [5], "b")
    hits = bm.match_prefix(b)
    assert len(hits) == 2
    assert bm.can_allocate(b, 1, hits)
    bm.allocate(b, 1, hits)
    assert bm.num_free_blocks == 1
    bm.free_seq(b)
    # Filling the pool with other tokens evicts the cached blocks.
    c = seq(range(100, 116), "c")
    bm.allocate(c, 16, [])
    assert bm.match_prefix(seq(list(range(8)) + [5], "d")) == []
    bm.free_seq(c)
    assert bm.num_free_blocks == 4


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(range(8), "a")
    bm.allocate(a, 8, [])
    a.num_computed_tokens = 8
    bm.commit(a)
    assert bm.match_prefix(seq(range(9), "b")) == []


def test_trim_frees_the_blocks_past_the_tokens_kept_first_in_line():
    # Speculative decoding: blocks only rejected draft tokens wrote go back, ahead of cached prefixes in the free list.
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(6))
    bm.allocate(s, 6, [])
    s.num_computed_tokens = 6
    bm.append(s, 1 + 8)  # its next token and 8 drafts: up to 15 tokens, 4 blocks
    assert len(s.block_table) == 4 and bm.num_free_blocks == 4
    extra = s.block_table[2:]
    bm.trim(s, 7)  # one draft accepted: 7 tokens computed, 2 blocks
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    assert list(bm.free)[:2] == extra  # the next handed out
    assert [bm.ref_counts[b] for b in extra] == [0, 0]
    bm.trim(s, 7)  # nothing more to free
    assert len(s.block_table) == 2
    bm.free_seq(s)
    assert bm.num_free_blocks == 8
