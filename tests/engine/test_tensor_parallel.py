"""Tensor parallelism over 2 gloo ranks on the CPU: greedy tokens equal one device's for every tiny architecture
(chunked prefill, preemption and prefix hits in one run per model), shards read only their slices, a size that
does not split the model fails before any rank starts, and a TP=2 worker serves jobs through Redis and stops when
its rank 1 is killed, its jobs finished by another worker."""

import os
import re
import signal
import socket
import subprocess
import sys

import pytest
import torch
from faults import check_all, log_of, make_requests, started, streaming_on, wait_for
from preemptions import record_preemptions
from test_parity import PROMPTS

from engine import EngineConfig, LLMEngine, SamplingParams
from engine import config as engine_config
from engine.parallel.shard import RANK_FAILED_EXIT, Shard

# Small enough a cache that nine prompts preempt one another; chunks of 64 tokens split the longer prompts.
CONFIG = {"num_kv_blocks": 14, "block_size": 8, "max_num_batched_tokens": 64, "max_num_seqs": 16}
SYSTEM = "You are a helpful assistant who answers in one sentence. "
PREFIXED = [SYSTEM + q for q in ("Who are you?", "What is red?")]


def run_scenarios(engine: LLMEngine, full: bool) -> tuple[list, list, int]:
    """Greedy tokens of the mixed prompts (full: all nine, preempting one another), then of two prompts sharing a
    prefix (the second run hits the first's blocks) -> (tokens, tokens, preemptions)."""
    preempted = record_preemptions(engine)
    greedy = SamplingParams(max_tokens=24 if full else 10, temperature=0)
    mixed = [o.token_ids for o in engine.generate(PROMPTS if full else PROMPTS[:4], greedy)]
    prefixed = []
    if full:
        engine.generate(PREFIXED[:1], greedy)
        outs = engine.generate(PREFIXED, greedy)
        assert all(o.num_cached_tokens > 0 for o in outs)
        prefixed = [o.token_ids for o in outs]
    assert engine.num_free_blocks == engine.num_total_blocks
    return mixed, prefixed, len(preempted)


# The scenarios run on one model in full; the others check what their architecture adds to the sharding. qwen2's
# ranks run as two nodes on loopback: rank 1 is `pagedq worker --node-rank 1`, as on a second host.
@pytest.mark.slow
@pytest.mark.parametrize("arch,kv_heads,full,nodes", [("llama", 2, True, 1), ("llama", 1, False, 1),
                                                      ("mistral", 2, False, 1), ("qwen2", 2, False, 2),
                                                      ("qwen3", 2, False, 1)])
def test_two_ranks_greedy_equal_one_device(tiny_model, arch, kv_heads, full, nodes):
    """llama is Llama 3 (llama3 rope scaling); kv_heads 1: fewer KV heads than ranks, replicated on both; qwen2:
    QKV biases, untied lm_head; qwen3: q/k norms."""
    path = tiny_model(arch, kv_heads=kv_heads)
    parallel = {"tensor_parallel_size": 2}
    node = None
    if nodes == 2:
        parallel.update(nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}")
        node = subprocess.Popen([sys.executable, "-m", "cli", "worker", "--model", path, "--tensor-parallel-size", "2",
                                 "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", parallel["dist_init_addr"],
                                 *(f"--{k.replace('_', '-')}={v}" for k, v in CONFIG.items())])
    one = run_scenarios(LLMEngine(EngineConfig(model=path, **CONFIG)), full)
    cores = os.sched_getaffinity(0)
    engine = LLMEngine(EngineConfig(model=path, **parallel, **CONFIG))
    try:
        if nodes == 1 and len(cores) >= 2:  # rank 0 on its half of the cores, rank 1 on the other
            assert os.sched_getaffinity(0) == set(sorted(cores)[: len(cores) // 2])
        attn = engine.runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # this rank's share of 4 heads and 2 (or 1) KV heads
        two = run_scenarios(engine, full)
        shard = engine.runner.shard
        # One host: all-reduces through shared memory; two nodes: through gloo.
        assert shard.comm_s["shm_all_reduce" if nodes == 1 else "all_reduce"] > 0
    finally:
        engine.close()
    assert os.sched_getaffinity(0) == cores  # given back: the process outlives the replica
    assert (one[2] > 0 and two[2] > 0) or not full  # both preempted
    assert two[:2] == one[:2]
    if node is not None:
        assert node.wait(timeout=30) == 0  # told to stop by rank 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not engine_config.cpu_has_bf16(), reason="no bfloat16 matmul units on this CPU: bfloat16 is emulated")
def test_two_ranks_in_bfloat16_stay_close_to_one_device(tiny_model):
    """bfloat16 sums the two ranks' halves of o_proj and down in another order than one device does, so tokens may
    part where two are near tied: the project's closeness rule for bfloat16 (tests/engine/test_cpu_dtypes.py) on the first
    token, and every token equal while one device's choice leads by a clear margin."""
    path = tiny_model("llama", kv_heads=2)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=5)
    runs = []
    for size in (1, 2):
        engine = LLMEngine(EngineConfig(model=path, dtype="bfloat16", tensor_parallel_size=size, **CONFIG))
        try:
            runs.append(tokens_and_logprobs(engine, params))
        finally:
            engine.close()
    for (tokens_one, lps_one), (tokens_two, lps_two) in zip(*runs, strict=True):
        (lp_one, top_one), (lp_two, top_two) = lps_one[0], lps_two[0]
        assert tokens_one[0] == tokens_two[0]
        assert abs(lp_one - lp_two) < 0.15
        assert len(set(top_one) & set(top_two)) >= 4
        for step, (a, b) in enumerate(zip(tokens_one, tokens_two, strict=True)):
            if a != b:
                ranked = sorted(lps_one[step][1].values(), reverse=True)
                assert ranked[0] - ranked[1] < 0.15, f"step {step}: {a} led by {ranked[0] - ranked[1]:.3f}, got {b}"
                break


def tokens_and_logprobs(engine: LLMEngine, params: SamplingParams) -> list[tuple[list[int], list]]:
    """Each prompt's greedy tokens and, per token, (its logprob, the top logprobs), gathered step by step."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params=params)
    got: dict[str, tuple[list[int], list]] = {str(i): ([], []) for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logprobs = got[out.request_id]
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.logprobs or [])
    return [got[str(i)] for i in range(len(PROMPTS))]


def test_a_size_that_does_not_split_the_model_fails_before_starting(tiny_model):
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLMEngine(EngineConfig(model=tiny_model("llama"), tensor_parallel_size=3))
    with pytest.raises(ValueError, match="overlap_steps"):
        EngineConfig(tensor_parallel_size=2, overlap_steps=True)


def test_each_rank_reads_only_its_slices(tiny_model):
    from transformers import AutoConfig

    from engine.models.llama import LlamaForCausalLM

    path = tiny_model("qwen2")  # untied lm_head and QKV biases: every kind of slice
    hf = AutoConfig.from_pretrained(path)

    def load(shard: Shard) -> LlamaForCausalLM:
        model = LlamaForCausalLM(hf, 64, shard)
        model.load_weights(path)
        return model

    whole, ranks = load(Shard()), [load(Shard(rank, 2)) for rank in range(2)]
    norms = sum(p.numel() * 4 for n, p in whole.named_parameters() if "norm" in n)
    for model in ranks:  # half of everything but the norms, which each rank holds whole
        assert model.bytes_read == pytest.approx((whole.bytes_read - norms) / 2 + norms, rel=0.01)
    # Stacked back together, the shards are the model: rank r's rows of QKV and of the vocabulary, its columns of
    # o_proj.
    attn = [m.model.layers[1].self_attn for m in ranks]
    full = whole.model.layers[1].self_attn
    q = attn[0].q_size
    assert torch.equal(torch.cat([a.qkv_proj.weight[:q] for a in attn]), full.qkv_proj.weight[: 2 * q])
    assert torch.equal(torch.cat([a.o_proj.weight for a in attn], dim=1), full.o_proj.weight)
    assert torch.equal(torch.cat([m.lm_head.weight for m in ranks])[: hf.vocab_size], whole.lm_head.weight)


@pytest.mark.slow
def test_two_rank_worker_serves_and_stops_when_rank_one_dies(redis_url, queue, rds, pq_tiny_model, start_worker,
                                                             pq_reference, pq_check_stream):
    from producer import Client

    flags = ("--max-num-seqs", "16", "--num-kv-blocks", "512", "--max-model-len", "256", "--lease-ms", "1500")
    c = Client(redis_url, queue=queue)
    a = start_worker(queue, pq_tiny_model, *flags, "--tensor-parallel-size", "2")
    wait_for(lambda: started(a), 120, "the TP=2 worker")
    # Streamed results equal one device's, and a cancelled job ends cancelled.
    first = make_requests(3, "tp", 12)
    results = [j.result(timeout=120) for j in c.submit_many(first)]
    check_all(c, first, results, pq_reference, pq_check_stream)
    long = c.submit(prompt="Count forever", max_tokens=400, temperature=0, ignore_eos=True)
    events = long.stream(timeout=120)
    assert next(events).type == "token"
    assert long.cancel() == "cancelling"
    assert list(events)[-1].type == "cancelled"

    # Rank 1 killed mid-generation: A stops with the reason; B finishes every job, none twice.
    b = start_worker(queue, pq_tiny_model, *flags)
    reqs = make_requests(16, "tpk", 16)
    jobs = c.submit_many(reqs)
    wait_for(lambda: streaming_on(rds, c, a.pid, reqs), 120, "A streaming")
    rank1 = int(re.search(r"tensor-parallel rank 1: pid (\d+)", log_of(a)).group(1))
    os.kill(rank1, signal.SIGKILL)
    assert a.wait(timeout=30) == RANK_FAILED_EXIT
    assert re.search(r"tensor-parallel rank 1 .* died with exit status -9: this worker stops", log_of(a))
    wait_for(lambda: started(b), 120, "worker B")
    results = [j.result(timeout=120) for j in jobs]
    stats = check_all(c, reqs, results, pq_reference, pq_check_stream)
    assert stats["resumed"] >= 1
