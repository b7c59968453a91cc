"""Preemption by priority and deadline (issue 39, engine part): an urgent request that a full batch stops preempts
running requests strictly less urgent than it, least urgent first, and joins in the same step; nothing else
changes for the preempted ones. The scheduler alone first, fed fake tokens (test_scheduler's helpers), then an
engine with a tiny random-weight model."""

import math

import pytest
from preemptions import record_preemptions
from test_scheduler import add, fake_step, make

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.group import Group
from engine.group_steps import GroupSteps
from engine.sequence import Sequence, Status

# ---- the scheduler, without a model ---------------------------------------------------------------------------


def full_batch(priorities, max_seqs=None, together=False, **kw):
    """A scheduler whose batch is full of requests of these priorities, each decoding -> (scheduler, its requests).
    Admitted in list order whatever the priorities, one per step, or together: in one step, by priority."""
    sched = make(max_seqs=max_seqs or len(priorities), **kw)
    seqs = []
    for i, p in enumerate(priorities):
        seqs.append(add(sched, f"r{i}", 5, max_tokens=50, priority=p, first=100 * i))
        if not together:
            fake_step(sched)
    fake_step(sched)
    assert [s.status for s in seqs] == [Status.RUNNING] * len(seqs)
    return sched, seqs


def ids(seqs):
    return [s.request_id for s in seqs]


def test_an_urgent_request_preempts_the_latest_of_a_full_batch_and_runs_in_the_next_step():
    sched, low = full_batch([10] * 4)
    urgent = add(sched, "urgent", 5, priority=0, first=900)
    out = sched.schedule()
    assert ids(out.preempted) == ["r3"]  # all equally urgent: the most recently admitted
    assert urgent in out.seqs and low[3] not in out.seqs and set(low[:3]) <= set(out.seqs)
    assert ids(sched.running) == ["r0", "r1", "r2", "urgent"] and ids(sched.waiting) == ["r3"]
    assert low[3].block_table == [] and low[3].num_computed_tokens == 0


@pytest.mark.parametrize("priority", [10, 11])
def test_an_equal_or_less_urgent_arrival_preempts_nothing(priority):
    sched, _ = full_batch([10] * 4)
    late = add(sched, "late", 5, priority=priority, first=900)
    for _ in range(3):
        out = fake_step(sched)
        assert not out.preempted and late not in out.seqs


def test_with_the_flag_off_nothing_is_preempted_for_priority():
    sched, _ = full_batch([10] * 4)
    sched.preempt_for_priority = False
    urgent = add(sched, "urgent", 5, priority=0, first=900)
    out = fake_step(sched)
    assert not out.preempted and urgent not in out.seqs
    assert sched.num_preemptible((0, math.inf)) == 0


def test_a_full_kv_pool_preempts_for_an_urgent_request_too():
    # 8 blocks of 4: four 5-token prompts hold 2 blocks each, all of them, and grow into them for 3 more tokens.
    sched, low = full_batch([10] * 4, max_seqs=16, together=True, num_blocks=8, prefix=False)
    assert sched.bm.num_free_blocks == 0 and sched.num_admittable() == 0
    urgent = add(sched, "urgent", 3, priority=0, first=900)
    out = sched.schedule()
    assert ids(out.preempted) == ["r3"] and urgent in out.seqs  # one victim frees the one block it needs


def test_no_preemption_that_would_not_make_room():
    # The urgent prompt needs 6 blocks: even both less urgent requests (2 blocks each) would not free enough.
    sched, _ = full_batch([0, 0, 10, 10], max_seqs=16, together=True, num_blocks=8,
                          prefix=False)
    urgent = add(sched, "urgent", 21, priority=0, first=900)
    out = sched.schedule()
    assert not out.preempted and urgent not in out.seqs


def test_deadline_orders_equal_priorities_in_waiting():
    sched = make(max_seqs=1)
    add(sched, "none", 3)
    add(sched, "late", 3, deadline=300.0)
    add(sched, "soon", 3, deadline=100.0)
    add(sched, "mid", 3, deadline=200.0)
    add(sched, "first", 3, priority=-1)  # priority before any deadline
    assert ids(sched.waiting) == ["first", "soon", "mid", "late", "none"]
    assert ids(sched.schedule().seqs) == ["first"]


def test_an_earlier_deadline_of_equal_priority_preempts():
    sched = make(max_seqs=2)
    add(sched, "a", 5, max_tokens=50, deadline=500.0)
    add(sched, "b", 5, max_tokens=50, first=100)  # no deadline: after any deadline
    fake_step(sched)
    soon = add(sched, "soon", 5, deadline=100.0, first=900)
    out = sched.schedule()
    assert ids(out.preempted) == ["b"] and soon in out.seqs
    assert sched.num_preemptible((0, 100.0)) == 1 and sched.num_preemptible((0, 500.0)) == 0


def test_victims_go_least_urgent_first_then_latest_first():
    sched, _ = full_batch([5, 9, 9, 1])
    assert sched.num_preemptible((5, math.inf)) == 2 and sched.num_preemptible((0, math.inf)) == 4
    preempted = []
    for i in range(4):
        add(sched, f"u{i}", 3, max_tokens=50, priority=0, first=900 + 10 * i)
        out = fake_step(sched)
        assert len(out.preempted) == 1 and f"u{i}" in ids(out.seqs)
        preempted += ids(out.preempted)
    assert preempted == ["r2", "r1", "r0", "r3"]
    assert sched.num_preemptible((0, math.inf)) == 0  # only equals left: nothing for another of priority 0


def test_memory_pressure_takes_the_least_urgent_not_the_latest():
    # 6 blocks of 4: two 8-token prompts take 2 each, then grow; the urgent one came last but stays.
    sched = make(num_blocks=6, prefix=False)
    low = add(sched, "low", 8, max_tokens=12, priority=5)
    fake_step(sched)
    urgent = add(sched, "urgent", 8, max_tokens=12, priority=0, first=100)
    preempted = []
    while sched.has_unfinished() and not preempted:
        preempted += fake_step(sched).preempted
    assert preempted == [low] and urgent.num_preemptions == 0


def test_memory_pressure_with_the_flag_off_takes_the_latest():
    sched = make(num_blocks=6, prefix=False)
    sched.preempt_for_priority = False
    add(sched, "low", 8, max_tokens=12, priority=5)
    fake_step(sched)
    urgent = add(sched, "urgent", 8, max_tokens=12, priority=0, first=100)
    preempted = []
    while sched.has_unfinished() and not preempted:
        preempted += fake_step(sched).preempted
    assert preempted == [urgent]


def add_group(sched, rid, n, priority, first):
    """A sampling request of n continuations (engine.group), waiting to be prefilled once and fork."""
    seq = Sequence(rid, list(range(first, first + 5)), SamplingParams(n=n, temperature=0.9, max_tokens=50), priority)
    seq.group = Group(rid, seq.params, [seq])
    sched.add(seq)
    return seq


def test_a_sampling_continuation_is_preempted_alone():
    """A forked sampling group's continuations are sequences of their own (sharing the prompt's blocks): an urgent
    request that needs one slot preempts one continuation, the latest, not the whole group."""
    sched = make(max_seqs=4)
    groups = GroupSteps(sched, sched.bm, lambda prompt, stop: None)
    add(sched, "a", 5, max_tokens=50, priority=5)
    fake_step(sched, groups=groups)
    g = add_group(sched, "g", 3, priority=10, first=100)
    fake_step(sched, groups=groups)  # g's prompt samples and forks: a and g's three continuations fill the batch
    fake_step(sched, groups=groups)
    assert len(sched.running) == 4 and g.group.forked
    assert sched.num_preemptible((0, math.inf)) == 4 and sched.num_preemptible((5, math.inf)) == 3
    add(sched, "urgent", 3, priority=0, first=900)
    last = g.group.seqs[2]
    out = fake_step(sched, groups=groups)
    assert out.preempted == [last]  # one slot was needed: one continuation goes
    assert ids(sched.running) == ["a", "g", "g", "urgent"] and last.block_table == []
    assert g.group.seqs[0].block_table and g.group.seqs[1].block_table
    while last not in sched.running:  # once there is room again it comes back, recomputed alone
        fake_step(sched, groups=groups)
    assert set(g.group.seqs) <= set(sched.running)


def test_an_urgent_group_preempts_as_many_as_it_runs():
    sched, _ = full_batch([10] * 4)
    groups = GroupSteps(sched, sched.bm, lambda prompt, stop: None)
    g = add_group(sched, "g", 2, priority=0, first=900)
    out = fake_step(sched, groups=groups)
    assert ids(out.preempted) == ["r3", "r2"]  # its prompt runs alone, but it holds both slots when it forks
    assert g in out.seqs and g.group.forked
    assert ids(sched.running) == ["r0", "r1", "g", "g"]


# ---- an engine with a tiny random-weight model ------------------------------------------------------------------

PROMPTS = [[5 + i, 17, 250 + 3 * i, 31, 8, 90 + i] * 3 for i in range(4)]
LOW = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * 2 + [
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7 + i, ignore_eos=True) for i in range(2)]
URGENT_PROMPT = [400, 12, 77, 3, 19]
URGENT = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def small_engine(model: str, overlap: bool = False, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model": model, "max_num_seqs": 4, "num_kv_blocks": 64,
                                     "attention_backend": "torch", "overlap_steps": overlap, **kw}))


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_an_urgent_request_joins_a_full_batch_at_once_and_changes_no_output(llama, overlap):
    engine = small_engine(llama, overlap)
    preempted = record_preemptions(engine)
    for i, (prompt, params) in enumerate(zip(PROMPTS, LOW)):
        engine.add_request(f"low{i}", prompt_token_ids=prompt, params=params, priority=10)
    streamed, final = {}, {}

    def step() -> set[str]:
        outs = engine.step()
        for o in outs:
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.request_finished:
                final[o.request_id] = o
        return {o.request_id for o in outs}

    for _ in range(4):
        step()
    assert engine.num_running == 4 and all(streamed.get(f"low{i}") for i in range(4))
    assert engine.num_preemptible(0) == 4 and engine.num_preemptible(10) == 0
    engine.add_request("urgent", prompt_token_ids=URGENT_PROMPT, params=URGENT, priority=0)
    # Its prefill is scheduled by the next step(): that call returns its first token, or with overlapped steps
    # the call after it (each returns the step launched by the call before).
    if overlap:
        assert "urgent" not in step()
    assert "urgent" in step()
    assert preempted == ["low3"]  # the batch was equally urgent: the latest admitted
    while engine.has_unfinished_requests():
        step()
    want = small_engine(llama, max_num_seqs=8).generate(PROMPTS + [URGENT_PROMPT], LOW + [URGENT])
    for rid, w in zip([f"low{i}" for i in range(4)] + ["urgent"], want, strict=True):
        assert final[rid].token_ids == w.token_ids, rid  # as undisturbed, token for token
        assert streamed[rid] == w.token_ids, rid  # every token streamed once: none repeated after the preemption


def test_num_preemptible_counts_the_strictly_less_urgent(llama):
    engine = small_engine(llama)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=LOW[0], priority=i, deadline=100.0 * i or None)
    engine.step()
    assert [engine.num_preemptible(p) for p in (-1, 0, 1, 2)] == [3, 2, 1, 0]
    assert engine.num_preemptible(1, deadline=50.0) == 2  # r1's deadline is 100: later than 50
    assert engine.num_preemptible(1, deadline=100.0) == 1
    assert engine.num_preemptible(2, deadline=100.0) == 1  # r2 has 200
    off = small_engine(llama, preempt_for_priority=False)
    off.add_request("r", prompt_token_ids=PROMPTS[0], params=LOW[0], priority=10)
    off.step()
    assert off.num_preemptible(0) == 0
