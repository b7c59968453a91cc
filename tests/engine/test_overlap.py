"""Overlapped steps (issue 10): launching step N+1 before building step N's outputs changes when outputs arrive,
never what they are. Forced on here; on a CPU it is off by default because the forward is synchronous."""

import threading

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sequence import PLACEHOLDER

PROMPTS = ["Hello there, how are you?", "The capital of France is", "a", "Once upon a time, in a land far away",
           "def fib(n):", "你好，世界！", "Q: What is 2 + 2?\nA:", "The quick brown fox"]


def make(path: str, overlap: bool, **kw) -> LLMEngine:
    cfg = dict(model=path, max_num_seqs=8, max_num_batched_tokens=64, block_size=8, num_kv_blocks=64,
               overlap_steps=overlap)
    return LLMEngine(EngineConfig(**(cfg | kw)))


def run(engine: LLMEngine, requests: list[tuple[int, str | list[int], SamplingParams]]
        ) -> tuple[dict[str, list], list]:
    """requests: (arrival step, prompt text or ids, params), added once that many steps have run -> each request's
    outputs, step by step, as (new tokens, new text, finish reason, logprobs), then its final token ids, text and
    cached prompt tokens; and every batch the scheduler made."""
    seen: dict[str, list] = {f"r{i}": [] for i in range(len(requests))}
    batches = []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        if batch.seqs:
            batches.append([(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        return batch

    engine.scheduler.schedule = spy
    calls = 0
    while calls == 0 or engine.has_unfinished_requests() or any(a >= calls for a, _, _ in requests):
        for i, (arrival, prompt, params) in enumerate(requests):
            if arrival == calls and isinstance(prompt, str):
                engine.add_request(f"r{i}", prompt=prompt, params=params)
            elif arrival == calls:
                engine.add_request(f"r{i}", prompt_token_ids=prompt, params=params)
        calls += 1
        for out in engine.step():
            events = seen[out.request_id]
            assert not events or not events[-1][2], f"{out.request_id}: an output after its last"
            events.append((out.new_token_ids, out.new_text, out.finish_reason, out.logprobs))
            if out.finished:
                events.append((out.token_ids, out.text, out.num_cached_tokens))
    assert engine.num_free_blocks == engine.num_total_blocks
    return seen, batches


def assert_same_outputs(got, want, path: str = "outputs") -> None:
    """Equal, but for logprobs: floats within float32 rounding. Two batch shapes (with overlap, a request shares its
    steps with others) can sum a matmul in two orders, so a logprob may differ in its last bits; tokens may not."""
    if isinstance(got, float) or isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-5), path
    elif isinstance(got, dict) and isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in got:
            assert_same_outputs(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_outputs(a, b, f"{path}[{i}]")
    else:
        assert got == want, path


def mixed_requests(path: str) -> list[tuple[int, str, SamplingParams]]:
    # A stop string and a stop token this model actually produces, read from a plain run.
    probe = make(path, overlap=False).generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0))[0]
    stop_text, stop_token = probe.text[6:8], probe.token_ids[5]
    assert stop_text
    plain = SamplingParams(max_tokens=20, temperature=0)
    return [
        (0, PROMPTS[0], plain),
        (0, PROMPTS[0], SamplingParams(max_tokens=24, temperature=0, stop=[stop_text])),
        (0, PROMPTS[0], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_token])),
        (1, PROMPTS[1], SamplingParams(max_tokens=17, temperature=0.9, top_p=0.9, seed=7)),
        (1, PROMPTS[2], SamplingParams(max_tokens=12, temperature=0, logprobs=3)),
        (2, PROMPTS[3], SamplingParams(max_tokens=15, temperature=0, min_tokens=5, repetition_penalty=1.3)),
        (3, PROMPTS[4], SamplingParams(max_tokens=1, temperature=0)),
        (3, PROMPTS[5], SamplingParams(max_tokens=30, temperature=0.7, top_k=20, seed=3)),
        (5, PROMPTS[6], plain),
        (9, PROMPTS[7], SamplingParams(max_tokens=9, temperature=0, stop=[stop_text, "\n"])),
    ]


def test_overlap_is_off_on_a_cpu_unless_asked(pq_tiny_model):
    assert LLMEngine(EngineConfig(model=pq_tiny_model, num_kv_blocks=16)).overlap is False


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [64, 14], ids=["roomy", "preempting"])
def test_overlapped_steps_give_the_same_outputs(pq_tiny_model, blocks):
    requests = mixed_requests(pq_tiny_model)
    plain, plain_batches = run(make(pq_tiny_model, overlap=False, num_kv_blocks=blocks), requests)
    overlapped, overlapped_batches = run(make(pq_tiny_model, overlap=True, num_kv_blocks=blocks), requests)
    assert_same_outputs(overlapped, plain)
    reasons = {events[-2][2] for events in plain.values()}
    assert reasons == {"stop", "length"}  # stop tokens, stop strings and lengths all ended something
    if blocks == 64:  # with room (no preemption to differ in), the scheduler makes the same batches...
        stopped = {rid for rid, events in plain.items() if events[-2][2] == "stop"}
        assert len(overlapped_batches) == len(plain_batches)
        extras = []
        for ours, theirs in zip(overlapped_batches, plain_batches):
            assert set(theirs) <= set(ours)
            extras += [row for row in ours if row not in theirs]
        # ...but for at most one decode row of a request a stop ended while that row was scheduled ahead of it: a
        # request that ends by length is never scheduled again.
        assert extras and len(set(extras)) == len(extras) and set(extras) <= {(rid, 1) for rid in stopped}


def ahead_requests(path: str) -> list[tuple[int, str, SamplingParams]]:
    """No logprobs or penalties: every step is scheduled while the one before it is still in flight. Two late
    requests repeat an early one's prompt and part of its output, so they hit blocks it filled while decoding."""
    probe = make(path, overlap=False)
    first = probe.generate([PROMPTS[3]], SamplingParams(max_tokens=40, temperature=0))[0]
    prompt = probe.tokenizer.encode(PROMPTS[3])
    stop_text = first.text[4:6]
    assert stop_text
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    return [
        (0, PROMPTS[3], greedy),
        (0, PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, stop=[stop_text])),
        (1, PROMPTS[1], SamplingParams(max_tokens=25, temperature=1.0, top_k=30, seed=11)),
        (2, PROMPTS[2], SamplingParams(max_tokens=3, temperature=0)),
        (2, PROMPTS[5], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[first.token_ids[7]])),
        (30, prompt + first.token_ids[:30], greedy),
        (34, prompt + first.token_ids[:12], SamplingParams(max_tokens=10, temperature=0.8, seed=5)),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [96, 10], ids=["roomy", "preempting"])
@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_steps_scheduled_ahead_give_the_same_outputs(pq_tiny_model, blocks, padded):
    requests = ahead_requests(pq_tiny_model)
    plain, _ = run(make(pq_tiny_model, overlap=False, num_kv_blocks=blocks), requests)
    engine = make(pq_tiny_model, overlap=True, num_kv_blocks=blocks)
    if padded:
        engine.runner.use_padded_decode(capture=False)  # the decode path CUDA graphs replay
    preempted_in_flight = []
    preempt = engine.scheduler._preempt

    def preempt_spy(seq):
        preempted_in_flight.append(seq.token_ids[-1] == PLACEHOLDER)  # its token still to land
        preempt(seq)

    engine.scheduler._preempt = preempt_spy
    fed = []
    launch = engine.runner.run

    def spy(batch, sampling, feed=None, *rest):
        fed.append("none" if feed is None else "all" if feed.rows is None else "some")
        return launch(batch, sampling, feed, *rest)

    engine.runner.run = spy
    overlapped, _ = run(engine, requests)
    assert_same_outputs(overlapped, plain)
    # Nearly every step took inputs from the one in flight: all rows in steady decoding, some when requests came
    # or went.
    assert fed.count("none") < len(fed) * 0.2 and {"all", "some"} <= set(fed)
    if blocks == 96:  # the late requests were served blocks the first one filled while decoding ahead
        assert overlapped["r5"][-1][2] >= 24
    else:  # requests were preempted while their last token was in flight; it still landed in their output
        assert any(preempted_in_flight)


def test_overlapped_outputs_arrive_one_call_later(pq_tiny_model):
    engine = make(pq_tiny_model, overlap=True)
    engine.add_request("a", prompt=PROMPTS[0], params=SamplingParams(max_tokens=2, temperature=0))
    assert engine.step() == []  # the prefill is launched; its token lands at the next call
    first = engine.step()
    assert [o.request_id for o in first] == ["a"] and not first[0].finished
    last = engine.step()
    assert last[0].finished and len(last[0].token_ids) == 2
    assert engine.step() == [] and not engine.has_unfinished_requests()


def test_a_request_aborted_while_its_step_runs_gets_no_more_outputs(pq_tiny_model):
    engine = make(pq_tiny_model, overlap=True)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for rid in "abc":
        engine.add_request(rid, prompt=PROMPTS[0], params=params)
    engine.step()
    engine.step()  # first tokens out; the second decode step is in flight with b in it
    assert engine.abort("b")
    assert engine.num_running == 2
    later = []
    while engine.has_unfinished_requests():
        later += engine.step()
    assert "b" not in {o.request_id for o in later}
    assert sorted(o.request_id for o in later if o.finished) == ["a", "c"]
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.mark.slow
def test_a_worker_serves_overlapped_steps(redis_url, queue, pq_tiny_model):
    from producer import Client
    from worker.worker import Worker, WorkerConfig

    requests = mixed_requests(pq_tiny_model)[:3]
    want = make(pq_tiny_model, overlap=False).generate([p for _, p, _ in requests], [s for _, _, s in requests])
    w = Worker(make(pq_tiny_model, overlap=True), WorkerConfig(redis_url=redis_url, queue=queue, block_ms=100))
    loop = threading.Thread(target=w.run, daemon=True)
    loop.start()
    try:
        with Client(redis_url, queue=queue) as c:
            jobs = c.submit_many([{"prompt": p, "max_tokens": s.max_tokens, "temperature": 0, "stop": s.stop,
                                   "stop_token_ids": s.stop_token_ids} for _, p, s in requests])
            for job, ref in zip(jobs, want):
                res = job.result(timeout=60)
                assert (res.token_ids, res.text, res.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
                streamed = list(job.stream(timeout=5))
                assert "".join(e.text for e in streamed if e.text) == ref.text
    finally:
        w.stop()
        loop.join(30)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_steady_decode_inputs_equal_a_full_build(pq_tiny_model, overlap):
    """A decode step of the same sequences as the step before carries positions and table rows over from it; what
    it builds must equal reading every sequence afresh (the ids too, unless they come from the device)."""
    import numpy as np

    from engine.runner import step_inputs

    engine = make(pq_tiny_model, overlap=overlap)
    steady = []
    build = step_inputs.build

    def checked(batch, tables, block_size, after=None, fed=False):
        inputs = build(batch, tables, block_size, after, fed)
        if after is not None:
            steady.append(len(batch.seqs))
            full = build(batch, tables, block_size)
            for name in ("positions", "slots", "query_start_loc", "seq_lens", "block_table", "sample_rows",
                         "table_rows") + (() if fed else ("input_ids",)):
                assert np.array_equal(getattr(inputs, name), getattr(full, name)), name
        return inputs

    step_inputs.build = checked
    try:
        run(engine, ahead_requests(pq_tiny_model))
    finally:
        step_inputs.build = build
    assert len(steady) > 20
