"""Greedy output equals transformers' generate(do_sample=False), token for token, in one mixed batch."""

import pytest
import torch
from preemptions import record_preemptions

from engine import EngineConfig, LLMEngine, SamplingParams

PROMPTS = [
    "Hello there, how are you?",
    "The capital of France is",
    " ".join(str(i) for i in range(1, 25)),
    "a",
    "Write a poem about the sea, the sky and the birds that fly between them at dawn.",
    "你好，世界！今天天气怎么样？",
    "def fib(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a land far away, there lived a",
    "Q: What is 2 + 2?\nA:",
]


def hf_greedy(path, prompts, max_new_tokens, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for p in prompts:
        ids = torch.tensor([tokenizer.encode(p)])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def check(engine, path, prompts, max_tokens):
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    ref = hf_greedy(path, prompts, max_tokens, engine.tokenizer)
    for prompt, o, r in zip(prompts, outs, ref):
        assert o.token_ids == r, f"prompt {prompt!r}"
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_models_match_transformers(tiny_model, arch):
    path = tiny_model(arch)
    engine = LLMEngine(EngineConfig(model=path, max_num_batched_tokens=96, block_size=16))
    check(engine, path, PROMPTS, 32)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_models_match_under_preemption(tiny_model, arch):
    path = tiny_model(arch)
    # 10 blocks of 8 tokens cannot hold nine requests at once: preemption must happen, and change nothing.
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=14, block_size=8, max_num_batched_tokens=64))
    preempted = record_preemptions(engine)
    check(engine, path, PROMPTS, 32)
    assert preempted


@pytest.mark.slow
def test_prefix_cache_hits_change_nothing(tiny_model):
    path = tiny_model("llama")
    engine = LLMEngine(EngineConfig(model=path, block_size=4))
    system = "You are a helpful assistant who answers in one sentence. " * 3
    prompts = [system + q for q in ("Who are you?", "What is red?", "Count to three.")]
    first = engine.generate(prompts[:1], SamplingParams(max_tokens=16, temperature=0))
    rest = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert rest[0].token_ids == first[0].token_ids
    assert all(o.num_cached_tokens > 0 for o in rest)
    ref = hf_greedy(path, prompts, 16, engine.tokenizer)
    assert [o.token_ids for o in rest] == ref


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    from engine.weights.loader import resolve_model

    prompts = PROMPTS[:8]
    outs = smollm2.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    ref = hf_greedy(str(resolve_model("smollm2-135m-instruct")), prompts, 16, smollm2.tokenizer)
    assert [o.token_ids for o in outs] == ref


@pytest.mark.slow
def test_smollm2_matches_under_preemption():
    from engine.weights.loader import resolve_model

    path = str(resolve_model("smollm2-135m-instruct"))
    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", num_kv_blocks=12, block_size=8,
                                    quantization="none"))
    check(engine, path, PROMPTS[:8], 12)
