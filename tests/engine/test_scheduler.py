"""The scheduler on the CPU without a model: fed fake sampled tokens, vLLM v1-test style."""

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status


def make(num_blocks=64, block_size=4, max_seqs=8, budget=64, prefix=True):
    return Scheduler(BlockManager(num_blocks, block_size, prefix), max_seqs, budget)


def add(sched, rid, n_prompt, max_tokens=8, priority=0, first=0, deadline=None):
    s = Sequence(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens), priority,
                 deadline=deadline)
    sched.add(s)
    return s


def fake_step(sched, token=7, groups=None):
    """One step with a fake model: every sequence that completes its tokens samples `token`. groups: the
    engine.group_steps.GroupSteps that forks sampling groups when their prompt samples, as the engine's step does."""
    out = sched.schedule()
    samplers = [s for s, n in zip(out.seqs, out.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
    if groups is not None:
        samplers, _ = groups.fork(samplers)
    for s, n in zip(out.seqs, out.num_new_tokens):
        s.num_computed_tokens += n
        sched.bm.commit(s)
    for s in samplers:
        s.token_ids.append(token)
        if s.num_output_tokens >= s.params.max_tokens:
            sched.finish(s, "length")
            if s.group is not None:
                groups.member_finished(s)
    return out


def run_to_end(sched, limit=1000):
    steps = 0
    while sched.has_unfinished():
        fake_step(sched)
        steps += 1
        assert steps < limit
    return steps


def test_admission_respects_token_budget_and_chunks_long_prompts():
    sched = make(budget=10)
    add(sched, "a", 6)
    add(sched, "b", 7)
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a", "b"]
    assert out.num_new_tokens == [6, 4]  # b gets the rest of the budget as a first chunk
    assert out.num_tokens <= 10


def test_decodes_go_first_then_waiting_prompts():
    sched = make(budget=8)
    add(sched, "a", 5)
    fake_step(sched)  # a prefilled and sampled its first token
    add(sched, "b", 20)
    out = sched.schedule()
    assert out.seqs[0].request_id == "a" and out.num_new_tokens[0] == 1
    assert out.seqs[1].request_id == "b" and out.num_new_tokens[1] == 7


def test_max_num_seqs_caps_the_running_set():
    sched = make(max_seqs=2)
    for i in range(4):
        add(sched, f"r{i}", 3)
    out = sched.schedule()
    assert len(out.seqs) == 2 and len(sched.waiting) == 2
    assert sched.num_admittable() == 0


def test_priority_orders_admission():
    sched = make(max_seqs=1)
    add(sched, "low", 3, priority=5)
    add(sched, "high", 3, priority=-1)
    assert sched.schedule().seqs[0].request_id == "high"


def test_preemption_frees_the_newest_and_it_resumes_with_its_tokens():
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens each need 2 blocks, then grow.
    sched = make(num_blocks=6, block_size=4, budget=64, prefix=False)
    a = add(sched, "a", 8, max_tokens=12)
    b = add(sched, "b", 8, max_tokens=12, first=100)
    fake_step(sched)
    assert a.status == b.status == Status.RUNNING
    preempted = []
    while b.num_preemptions == 0:
        out = fake_step(sched)
        preempted += out.preempted
        assert len(sched.running) >= 1
    assert preempted[0] is b  # the most recently admitted goes first
    assert sched.waiting[0] is b and b.block_table == [] and b.num_computed_tokens == 0
    generated_before = b.output_token_ids
    assert generated_before  # it keeps what it generated; recompute covers prompt + those tokens
    run_to_end(sched)
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert b.output_token_ids[: len(generated_before)] == generated_before
    assert sched.bm.num_free_blocks == 6


def test_resumed_request_recomputes_prompt_and_output():
    sched = make(num_blocks=6, block_size=4, budget=64, prefix=False)
    add(sched, "a", 8, max_tokens=12)
    b = add(sched, "b", 8, max_tokens=12, first=100)
    fake_step(sched)
    while b.num_preemptions == 0:
        fake_step(sched)
    while b.status != Status.RUNNING:
        out = fake_step(sched)
    # The step that re-admitted b scheduled all its tokens but the last as one prefill, then sampled.
    idx = out.seqs.index(b)
    assert out.num_new_tokens[idx] == b.num_tokens - 1


def test_abort_frees_blocks_at_once():
    sched = make(num_blocks=16)
    a = add(sched, "a", 10)
    add(sched, "b", 3)
    fake_step(sched)
    before = sched.bm.num_free_blocks
    held = len(a.block_table)
    sched.finish(a, "abort")
    assert sched.bm.num_free_blocks == before + held
    assert "a" not in sched.by_id and a.status == Status.FINISHED
    run_to_end(sched)
    assert sched.bm.num_free_blocks == 16


def test_abort_of_a_waiting_request():
    sched = make(max_seqs=1)
    add(sched, "a", 3)
    b = add(sched, "b", 3)
    sched.schedule()
    sched.finish(b, "abort")
    assert not sched.waiting and sched.bm.num_free_blocks == 63


def test_no_leak_after_many_requests_with_shared_prefixes():
    sched = make(num_blocks=12, block_size=4, max_seqs=4, budget=16)
    for i in range(30):
        add(sched, f"r{i}", 5 + i % 7, max_tokens=3 + i % 5)
    run_to_end(sched)
    assert sched.bm.num_free_blocks == 12
    assert all(r == 0 for r in sched.bm.ref_counts)
    assert not sched.running and not sched.waiting


def test_prefix_hits_are_counted_as_cached_tokens():
    sched = make(block_size=4)
    add(sched, "a", 13)
    run_to_end(sched)
    b = add(sched, "b", 13)
    fake_step(sched)
    assert b.num_cached_tokens == 12


def test_num_admittable_counts_waiting_and_blocks():
    sched = make(num_blocks=4, block_size=4, max_seqs=8)
    assert sched.num_admittable() == 4  # limited by blocks
    add(sched, "a", 8)  # waiting, will need 2 blocks
    assert sched.num_admittable() == 2
