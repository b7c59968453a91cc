"""What the tests of several continuations per prompt (parallel sampling, beam search) share: prompts, and a run
that checks the KV block accounting after every step."""

from engine import LLMEngine
from engine.sequence import Status

# 37 tokens: two full blocks of 16 and a partly filled third, which the continuations share until they write.
PROMPT = list(range(100, 137))
OTHER = [5, 9, 200, 31] * 6


def run_checking_blocks(engine: LLMEngine) -> dict:
    """Run to the end, checking after every step that each block is free or referenced exactly as often as block
    tables name it -> each request's last output."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_finished:
                final[out.request_id] = out
        assert_blocks_accounted(engine)
    assert engine.num_free_blocks == engine.num_total_blocks
    return final


def assert_blocks_accounted(engine: LLMEngine) -> None:
    bm = engine.block_manager
    live = [s for s in engine.scheduler.running + engine.scheduler.waiting if s.status is not Status.FINISHED]
    named: dict[int, int] = {}
    for seq in live:
        for block in seq.block_table:
            named[block] = named.get(block, 0) + 1
    for block, count in enumerate(bm.ref_counts):
        assert count == named.get(block, 0), f"block {block}: {count} references, {named.get(block, 0)} in tables"
        assert (count == 0) == (block in bm.free), f"block {block} is both referenced and free, or neither"
