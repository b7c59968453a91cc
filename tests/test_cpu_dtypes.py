"""The CPU fast path: bfloat16 with prepacked weights, dtype auto, and how close bfloat16 stays to float32."""

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine import config as engine_config
from engine.packed_linear import PackedLinear

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "The first president of the United States was"]


def _bf16_units() -> bool:
    return engine_config.cpu_has_bf16()


def test_dtype_auto_follows_the_cpu(monkeypatch):
    monkeypatch.setattr(engine_config, "cpu_has_bf16", lambda: True)
    assert EngineConfig(dtype="auto").dtype == "bfloat16"
    monkeypatch.setattr(engine_config, "cpu_has_bf16", lambda: False)
    assert EngineConfig(dtype="auto").dtype == "float32"
    assert EngineConfig(device="cuda", dtype="auto").dtype == "bfloat16"
    assert EngineConfig().dtype == "float32"  # the default stays exact on CPU
    with pytest.raises(ValueError, match="auto"):
        EngineConfig(dtype="half-ish")


def test_batch_limits_default_by_device():
    cpu, cuda = EngineConfig(), EngineConfig(device="cuda")
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == engine_config.BATCH_LIMITS["cpu"]
    assert (cuda.max_num_seqs, cuda.max_num_batched_tokens) == engine_config.BATCH_LIMITS["cuda"]
    assert EngineConfig(max_num_seqs=3).max_num_seqs == 3


def _greedy(engine, n=12):
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])  # qwen2: biased qkv; qwen3: q/k norms
def test_prepacked_bfloat16_gives_the_same_tokens(tiny_model, arch):
    path = tiny_model(arch)
    packed = LLMEngine(EngineConfig(model=path, dtype="bfloat16", num_kv_blocks=64))
    plain = LLMEngine(EngineConfig(model=path, dtype="bfloat16", num_kv_blocks=64, prepack_weights=False))
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        pytest.skip("this torch build has no oneDNN prepacked linear")
    assert any(isinstance(m, PackedLinear) for m in packed.runner.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.runner.model.modules())
    assert _greedy(packed) == _greedy(plain)


def test_float32_is_never_prepacked(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=64))
    assert not any(isinstance(m, PackedLinear) for m in engine.runner.model.modules())


@pytest.mark.skipif(not _bf16_units(), reason="no bfloat16 matmul units on this CPU: bfloat16 is emulated")
def test_bfloat16_stays_close_to_float32():
    """On a real model: the first token's choice and log-probability barely move from float32 to bfloat16."""
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", dtype=dtype, max_num_seqs=8,
                                        num_kv_blocks=64))
        runs[dtype] = engine.generate(PROMPTS, params)
    for full, half in zip(runs["float32"], runs["bfloat16"]):
        assert full.token_ids == half.token_ids
        (lp_full, top_full), (lp_half, top_half) = full.logprobs[0], half.logprobs[0]
        assert abs(lp_full - lp_half) < 0.15
        assert len(set(top_full) & set(top_half)) >= 4
    assert torch.get_default_dtype() == torch.float32  # loading in bfloat16 leaves the process default alone
