"""The CPU fast path: bfloat16 with prepacked weights, dtype auto, and how close bfloat16 stays to float32."""

import pytest
import torch
from torch import nn

from engine import EngineConfig, LLMEngine, SamplingParams
from engine import config as engine_config
from engine.weights.loader import cache_root
from engine.weights.packed import PackedLinear, PanelLinear, pack_linears

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


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])  # qwen2: biased qkv; qwen3: q/k norms
def test_prepacked_weights_give_the_same_tokens(tiny_model, arch, dtype):
    path = tiny_model(arch)
    packed = LLMEngine(EngineConfig(model=path, dtype=dtype, num_kv_blocks=64))
    plain = LLMEngine(EngineConfig(model=path, dtype=dtype, num_kv_blocks=64, prepack_weights=False))
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        pytest.skip("this torch build has no oneDNN prepacked linear")
    kinds = {type(m) for m in packed.runner.model.modules()}
    panels = dtype in packed.runner.backend.linear_paths
    # Where this CPU has a panel path for the dtype, every layer fits it; else oneDNN's layout.
    assert (PanelLinear in kinds) == panels and (PackedLinear in kinds) != panels
    assert not {PackedLinear, PanelLinear} & {type(m) for m in plain.runner.model.modules()}
    gated = [layer.mlp.gate_up_proj.activates for layer in packed.runner.model.model.layers if panels]
    assert all(gated) if dtype == "bfloat16" else not any(gated)  # float32's SiLU stays torch's
    assert _greedy(packed) == _greedy(plain)


def test_layers_the_panels_do_not_fit_go_to_onednn():
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        pytest.skip("this torch build has no oneDNN prepacked linear")
    from pagedq_kernels import Backend, build, get_backend

    def model() -> nn.Module:
        torch.manual_seed(0)
        m = nn.ModuleDict({"wide": nn.Linear(64, 96), "odd": nn.Linear(40, 64, bias=False),
                           "gate_up_proj": nn.Linear(64, 2 * 24, bias=False)})  # 24: halves not a multiple of 16
        return m.to(torch.bfloat16)

    without = model()
    assert pack_linears(without, 8, Backend("no panels", None, None)) == 3
    assert all(type(m) is PackedLinear for m in without.values())
    backend = get_backend("cpu", "cpu", build.default_root(cache_root()))
    if "bfloat16" not in backend.linear_paths:
        pytest.skip("no bfloat16 panel path on this CPU (it lacks AVX512_BF16 and AMX)")
    mixed = model()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    want = model()["wide"](x)
    assert pack_linears(mixed, 8, backend) == 3
    assert [type(m) for m in mixed.values()] == [PanelLinear, PackedLinear, PanelLinear]
    assert not mixed["gate_up_proj"].activates  # the MLP applies SiLU-and-multiply itself
    torch.testing.assert_close(mixed["wide"](x), want, rtol=2**-7, atol=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(not _bf16_units(), reason="no bfloat16 matmul units on this CPU: bfloat16 is emulated")
def test_bfloat16_stays_close_to_float32():
    """On a real model: the first token's choice and log-probability barely move from float32 to bfloat16."""
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", dtype=dtype, max_num_seqs=8,
                                        num_kv_blocks=64, quantization="none"))
        runs[dtype] = engine.generate(PROMPTS, params)
    for full, half in zip(runs["float32"], runs["bfloat16"]):
        assert full.token_ids == half.token_ids
        (lp_full, top_full), (lp_half, top_half) = full.logprobs[0], half.logprobs[0]
        assert abs(lp_full - lp_half) < 0.15
        assert len(set(top_full) & set(top_half)) >= 4
    assert torch.get_default_dtype() == torch.float32  # loading in bfloat16 leaves the process default alone
