"""The engine on the Triton kernels (under the interpreter) gives the torch backend's greedy tokens."""

import pytest
from preemptions import record_preemptions

from engine import EngineConfig, LLMEngine, SamplingParams

PROMPTS = [
    "Hello there, how are you?",
    "The capital of France is",
    " ".join(str(i) for i in range(1, 25)),
    "a",
    "def fib(n):\n    if n < 2:\n        return n\n    return",
    "Q: What is 2 + 2?\nA:",
]


def greedy(engine, prompts, max_tokens):
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_total_blocks
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_same_tokens_under_preemption(tiny_model, arch):
    path = tiny_model(arch)
    # Too few blocks for all six at once, and a small token budget: chunked prefill, mixed steps, preemption.
    cfg = dict(model=path, num_kv_blocks=10, block_size=8, max_num_batched_tokens=32, max_model_len=64)
    want = [o.token_ids for o in greedy(LLMEngine(EngineConfig(**cfg, attention_backend="torch")), PROMPTS, 16)]
    engine = LLMEngine(EngineConfig(**cfg, attention_backend="triton"))
    preempted = record_preemptions(engine)
    assert [o.token_ids for o in greedy(engine, PROMPTS, 16)] == want
    assert preempted


@pytest.mark.slow
def test_same_tokens_with_prefix_cache_hits(tiny_model):
    path = tiny_model("llama")
    system = "You are a helpful assistant who answers in one sentence. " * 2
    prompts = [system + q for q in ("Who are you?", "What is red?", "Count to three.")]
    cfg = dict(model=path, block_size=4, max_model_len=128, num_kv_blocks=96)
    ref = LLMEngine(EngineConfig(**cfg, attention_backend="torch"))
    want = [o.token_ids for o in greedy(ref, prompts, 12)]
    engine = LLMEngine(EngineConfig(**cfg, attention_backend="triton"))
    greedy(engine, prompts[:1], 12)
    outs = greedy(engine, prompts, 12)
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert [o.token_ids for o in outs] == want
