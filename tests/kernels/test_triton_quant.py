"""The Triton dequantize-matmul (pagedq_kernels/triton_quant.py) under TRITON_INTERPRET=1 (set in conftest): weights equal
to Blocks.dequantize()'s bit for bit, products against a float matmul of the same weights for every format, odd
shapes and tails, both launch shapes; and the engine on the triton backend with weights kept quantized."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedq_kernels import quant_layout, triton_quant
from pagedq_kernels.quant_layout import Blocks

gguf = pytest.importorskip("gguf")
FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def gguf_blocks(fmt: str, n: int, k: int, seed: int = 0) -> Blocks:
    """A GGUF tensor of format fmt read into Blocks: quantized from random weights, or (K-quants, which the gguf
    package cannot quantize) random blocks with small finite super-block scales."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[fmt]
    if fmt not in ("Q4_K", "Q6_K"):
        raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1, qtype)
    else:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
        for at in ([0, 2] if fmt == "Q4_K" else [208]):
            raw[..., at:at + 2] = (rng.random((n, k // block)) * 0.01).astype(np.float16)[..., None].view(np.uint8)
        raw = raw.reshape(n, -1)
    return quant_layout.READERS[fmt](raw)


def random_blocks(bits: int, block: int, n: int, k: int, seed: int = 0) -> Blocks:
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 2**bits, (n, k), dtype=np.uint8)
    scale = (rng.random((n, k // block)) * 0.02).astype(np.float32)
    return Blocks(u, scale, -scale * 2 ** (bits - 1) + rng.standard_normal(scale.shape).astype(np.float32) * 0.01,
                  bits, block)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error over the largest reference magnitude."""
    return ((got.double() - want).abs().max() / want.abs().max()).item()


TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def check(blocks: Blocks, m: int, dtype: torch.dtype, bias: bool, seed: int = 0) -> None:
    n, k = blocks.u.shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    w = torch.from_numpy(blocks.dequantize())
    got = triton_quant.quant_linear(x, triton_quant.device_weight(blocks, "cpu"), b)
    assert got.dtype == dtype and got.shape == (m, n)
    # The kernel's weights are rounded to x's dtype, then summed in float32 (float64 here).
    want = F.linear(x.double(), w.to(dtype).double(), None if b is None else b.double())
    assert rel_err(got, want) < TOL[dtype]
    # and against the float32 matmul of the unrounded weights (x's dtype rounds them once more)
    assert rel_err(got, F.linear(x.float(), w, b).double()) < max(3 * TOL[dtype], 1e-5)


@pytest.mark.parametrize("fmt", FORMATS + ["int8"])
def test_weights_are_the_blocks_exactly(fmt):
    # x = rows of an identity: out = W.T's rows, each a sum of one weight and zeros, so the kernel's weights show
    # as they are; 256 rows (the prefill shape) and 16 of them spread over K (decode, K split over programs).
    if fmt == "int8":
        blocks = quant_layout.int8_per_channel(np.random.default_rng(3).standard_normal((20, 256)).astype(np.float32))
    else:
        blocks = gguf_blocks(fmt, 20, 256)
    w = triton_quant.device_weight(blocks, "cpu")
    want = torch.from_numpy(blocks.dequantize()).T
    eye = torch.eye(256)
    assert torch.equal(triton_quant.quant_linear(eye, w), want)
    rows = torch.arange(7, 256, 16)
    assert triton_quant.splits_for(20, 256, torch.device("cpu"))[0] > 1
    assert torch.equal(triton_quant.quant_linear(eye[rows], w), want[rows])


# (bits, block, M, N, K): M 1 and 3 take the decode shape, 17 and 64 the prefill one; N off the 64 tile; K a
# multiple of the block but not of the 64-wide K step.
SHAPES = [
    (4, 32, 1, 70, 96),
    (4, 32, 3, 33, 160),
    (4, 32, 17, 129, 64),
    (4, 32, 64, 40, 224),
    (8, 32, 1, 129, 160),
    (8, 32, 17, 70, 96),
    (8, 16, 3, 70, 48),
    (8, 16, 64, 33, 80),
    (8, 16, 1, 1, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits, block, m, n, k", SHAPES)
def test_matches_a_float_matmul(bits, block, m, n, k, dtype):
    check(random_blocks(bits, block, n, k, seed=m + n), m, dtype, bias=(m + n) % 2 == 0)


@pytest.mark.parametrize("fmt, m", [("Q8_0", 1), ("Q4_0", 17), ("Q4_1", 3), ("Q4_K", 64), ("Q6_K", 1)])
def test_every_gguf_format(fmt, m):
    check(gguf_blocks(fmt, 24, 256, seed=m), m, torch.float16, bias=True)


@pytest.mark.parametrize("parts, layout", [(("Q4_K", "Q6_K"), (8, 16)), (("Q4_1", "Q8_0"), (8, 32)),
                                           (("Q4_0", "Q4_K"), (4, 32))])
def test_fused_layers_of_mixed_formats(parts, layout):
    from pagedq_kernels.quant_layout import stack

    blocks = stack([gguf_blocks(f, 16 + 8 * i, 256, seed=i) for i, f in enumerate(parts)])
    assert (blocks.bits, blocks.block) == layout
    for m in (1, 17):
        check(blocks, m, torch.float32, bias=False)


def test_bfloat16_and_batched_inputs():
    # bfloat16 runs upcast under the interpreter (which computes it wrongly): this checks the wrapper, not the
    # kernel's bfloat16 (gpu-check does, on a GPU). Inputs [..., K] keep their leading dimensions; 0 rows work.
    blocks = random_blocks(4, 32, 40, 64)
    w = triton_quant.device_weight(blocks, "cpu")
    x = torch.randn(2, 3, 64)
    ref = F.linear(x, torch.from_numpy(blocks.dequantize()))
    got = triton_quant.quant_linear(x.bfloat16(), w)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 40)
    assert rel_err(got, ref.double()) < TOL[torch.bfloat16]
    assert triton_quant.quant_linear(x[:, :0], w).shape == (2, 0, 40)
    strided = torch.randn(3, 128)[:, ::2]
    assert rel_err(triton_quant.quant_linear(strided, w), F.linear(strided, ref.new_tensor(blocks.dequantize())
                                                                   ).double()) < 1e-6


def test_split_k_fills_the_gpu_and_covers_k():
    cpu = torch.device("cpu")  # the interpreter plans for an H200's 132 SMs
    for n, k in [(576, 576), (4096, 4096), (49152, 576), (64, 8192), (20, 64)]:
        for wide in (False, True):
            splits, span = triton_quant.splits_for(n, k, cpu, wide)
            t = triton_quant.tiles(True, wide)
            columns, steps = -(-n // t["BLOCK_N"]), -(-k // t["BLOCK_K"])
            assert span % t["BLOCK_K"] == 0 and (splits - 1) * span < k <= splits * span
            assert splits <= triton_quant.MAX_SPLITS
            # equal spans round the count down, never below half of what fills the GPU twice (or K allows)
            assert 2 * columns * splits >= min(2 * 132, columns * min(steps, triton_quant.MAX_SPLITS))


def test_per_block_dtype_is_float16_only_where_exact():
    layouts = {"Q8_0": torch.float16, "Q4_0": torch.float16, "Q4_1": torch.float16, "Q4_K": torch.float32,
               "Q6_K": torch.float32}
    for fmt, dtype in layouts.items():
        w = triton_quant.device_weight(gguf_blocks(fmt, 8, 256), "cpu")
        assert w.scale.dtype == w.min.dtype == dtype, fmt
        per_weight = {4: 0.5, 8: 1}[w.bits] + 2 * w.scale.element_size() / w.block
        assert w.nbytes == 8 * 256 * per_weight
    int8 = quant_layout.int8_per_channel(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32))
    assert triton_quant.device_weight(int8, "cpu").scale.dtype == torch.float16  # its scales rounded to float16s
    int8.scale[0, 0] += 2**-20  # one scale a float16 cannot hold: the whole layer's float32
    assert triton_quant.device_weight(int8, "cpu").scale.dtype == torch.float32


def test_bad_inputs_say_what_is_wrong():
    w = triton_quant.device_weight(random_blocks(8, 32, 8, 64), "cpu")
    with pytest.raises(ValueError, match="takes 64"):
        triton_quant.quant_linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        triton_quant.quant_linear(torch.ones(2, 64, dtype=torch.int32), w)
    with pytest.raises(ValueError, match="no Triton kernel for 3-bit"):
        triton_quant.device_weight(Blocks(np.zeros((8, 64), np.uint8), np.ones((8, 2), np.float32),
                                          np.zeros((8, 2), np.float32), 3, 32), "cpu")
    with pytest.raises(ValueError, match="K a multiple of the block"):
        triton_quant.device_weight(Blocks(np.zeros((8, 40), np.uint8), np.ones((8, 1), np.float32),
                                          np.zeros((8, 1), np.float32), 8, 32), "cpu")
    with pytest.raises(ValueError, match="above 15"):
        triton_quant.device_weight(Blocks(np.full((8, 64), 16, np.uint8), np.ones((8, 2), np.float32),
                                          np.zeros((8, 2), np.float32), 4, 32), "cpu")


def test_triton_backend_advertises_the_quantized_path():
    from pagedq_kernels import get_backend

    backend = get_backend("triton", "cpu")  # the interpreter
    assert backend.linear_paths["quantized"] == "triton"
    assert "quantized: triton" in backend.describe()


@pytest.mark.slow
def test_engine_int8_on_the_triton_backend(tiny_model, monkeypatch):
    """int8 weights kept quantized through the Triton kernel give the greedy tokens of the torch backend on the
    same weights dequantized to float32."""
    from torch import nn

    # The interpreter spends ~10 ms a program: 1024 output columns a program, not 64, take the lm_head (49,152
    # columns) from seconds a step to a fraction of one. The kernel's code is the same; the tests above run its tiles.
    tiles = triton_quant.tiles
    monkeypatch.setattr(triton_quant, "tiles", lambda decode, wide: {**tiles(decode, wide), "BLOCK_N": 1024})

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.weights.quantized import made_at_load

    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    params = SamplingParams(max_tokens=6, temperature=0)
    # not prepacked: the reference's F.linear must read the weights set below, not panels packed at load
    cfg = dict(model=tiny_model(), num_kv_blocks=32, max_num_seqs=4, prepack_weights=False)
    engine = LLMEngine(EngineConfig(**cfg, quantization="int8", attention_backend="triton"))
    layers = engine.runner.quantized
    assert {(r.format, r.path) for r in layers} == {("int8", "triton")}
    assert any(r.name == "lm_head" for r in layers)
    assert all(isinstance(m, triton_quant.TritonQuantLinear) for name, m in engine.runner.model.named_modules()
               if name in {r.name for r in layers})
    ref = LLMEngine(EngineConfig(**cfg, quantization="none", attention_backend="torch"))
    model = ref.runner.model
    for name, (blocks, _) in made_at_load(model, "int8").items():
        linear = model.get_submodule(name)
        assert type(linear) is nn.Linear
        linear.weight = nn.Parameter(torch.from_numpy(blocks.dequantize()), requires_grad=False)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    assert [o.token_ids for o in engine.generate(prompts, params)] == want


@pytest.mark.slow
def test_every_variant_compiles_for_hopper(tmp_path):
    # The interpreter accepts what Hopper's compiler may refuse: compile every launch quant_linear makes (layouts,
    # dtypes, decode split or not, prefill with bias) for sm_90a as a launch specializes it; none may spill.
    from compile_triton import compiled_for_hopper

    rows = compiled_for_hopper("quant", tmp_path)
    names = {row["variant"].split(" (")[0] for row in rows}
    for bits, block in ((4, 32), (8, 32), (8, 16)):
        for dt in ("bf16", "fp16", "fp32"):
            for kind in ("split-K", "prefill"):
                assert f"quant {kind:7s} {bits}-bit block {block} {dt}" in names
    assert all(row["cp_async"] and row["hinted_args"] for row in rows)
    assert not [row["variant"] for row in rows if row["spill_stores"] + row["spill_loads"]]
