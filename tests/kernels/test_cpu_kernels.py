"""The C++ kernels of the CPU path (pagedq_kernels/cpu_attention.cpp, cpu_prefill.cpp, cpu_layers.cpp, cpu_sampling.cpp,
cpu_linear.cpp, built on first use) against the torch ops they replace, the engine on them, and how a backend is
chosen on a CPU with and without a compiler. Kernel paths this CPU lacks are skipped by name; tests/conftest.py
prints which ran."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.weights.loader import cache_root
from pagedq_kernels import build, cpu_ops, get_backend, torch_ops
from pagedq_kernels.testing import attend, oracle, random_batch, rel_err, store, with_padding_rows

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built():
    # The engine's own build (tests/kernels/test_kernel_build.py builds afresh, killed and racing).
    why = cpu_ops.load(build.default_root(cache_root()))
    assert why is None, why  # CI machines have a C++ compiler: a failed build is a failure, never a skip
    return cpu_ops


@pytest.mark.parametrize("hq, hkv, head_dim", [(9, 3, 64), (8, 8, 16), (8, 2, 128), (4, 1, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_reads_the_blocks_in_place(built, hq, hkv, head_dim, dtype):
    # Decodes of many lengths (one token, a block edge, several blocks) beside prefills and a chunk after a cached
    # prefix; unwritten slots hold NaN, which a kernel that reads past a sequence's end would spread.
    shapes = [(0, 7), (15, 1), (16, 1), (0, 1), (40, 1), (5, 6), (100, 1), (31, 1)]
    b = random_batch(hq, hkv, head_dim, 16, shapes, dtype, seed=head_dim)
    store(torch_ops, b)
    got = attend(built, b)
    want = attend(torch_ops, b)
    decode = [i for i, (_, n) in enumerate(shapes) if n == 1]
    rows = b["query_start_loc"][decode].long()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got[rows], oracle(b)[rows]) < tol
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("block_size", [8, 32, 64])
@pytest.mark.parametrize("hq, hkv, head_dim", [(16, 1, 64), (17, 1, 32), (12, 2, 96)])
def test_bfloat16_attention_on_amx_tiles_and_past_them(built, block_size, hq, hkv, head_dim):
    # Where the CPU has AMX, bfloat16 decodes and prefills of head sizes a multiple of 32 (96: an odd number of
    # 32-dim tiles), in blocks a multiple of 16 tokens, with up to 16 query heads per KV head run on tiles; 8-token
    # blocks and 17 query heads take the AVX-512 paths. Long sequences cross many blocks; 32-key tiles end inside one.
    amx_flags = " amx_bf16 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    assert torch.ops.pagedq.decode_uses_amx() == amx_flags
    shapes = [(0, 1), (1, 1), (16, 1), (47, 1), (64, 1), (300, 1), (700, 1), (0, 40), (20, 33), (100, 17), (0, 2)]
    b = random_batch(hq, hkv, head_dim, block_size, shapes, torch.bfloat16, seed=block_size + hq)
    store(torch_ops, b)
    assert rel_err(attend(built, b), oracle(b)) < 1e-2


@pytest.mark.parametrize("hq, hkv, head_dim", [(9, 3, 64), (8, 8, 16), (8, 2, 128), (4, 1, 32), (10, 2, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_reads_the_blocks_in_place(built, hq, hkv, head_dim, dtype):
    # Prompts of many lengths (two tokens, a block, past a key tile, several query tiles), chunks after a cached
    # prefix (ending inside a block, starting on a block edge, three tokens after 45), beside decodes; unwritten
    # slots hold NaN, which a kernel that reads past a sequence's end would spread. Items fill one, two or three
    # registers of 16 rows (the kernel computes only those): (0, 2) and (45, 3) one, (7, 9) two for 3 heads a group.
    shapes = [(0, 2), (0, 16), (0, 33), (0, 130), (7, 9), (32, 50), (45, 3), (20, 1), (0, 1)]
    b = random_batch(hq, hkv, head_dim, 16, shapes, dtype, seed=head_dim + 1)
    store(torch_ops, b)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(attend(built, b), oracle(b)) < tol


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_prefill_with_other_block_sizes_and_query_heads_past_the_kernel(built, block_size):
    b = random_batch(6, 2, 32, block_size, [(0, 40), (13, 21), (3, 1)], torch.float32, seed=block_size)
    store(torch_ops, b)
    assert rel_err(attend(built, b), oracle(b)) < 1e-5
    wide = random_batch(64, 1, 16, block_size, [(0, 5), (4, 3)], torch.float32)  # more query heads per KV head
    store(torch_ops, wide)  # than the kernel's rows: the torch ops serve them
    assert torch.ops.pagedq.prefill_max_group() < 64
    assert torch.equal(attend(built, wide), attend(torch_ops, wide))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_copies_each_token_to_its_slot(built, dtype):
    b = random_batch(9, 3, 64, 16, [(0, 7), (15, 1), (5, 6)], dtype)
    qkv = torch.randn(len(b["k"]), 15 * 64).to(dtype)  # k and v as the model has them: views of one projection
    k, v = qkv[:, 9 * 64 : 12 * 64].view(-1, 3, 64), qkv[:, 12 * 64 :].view(-1, 3, 64)
    slots = b["slot_mapping"].clone()
    slots[3] = -1  # skipped
    want_k, want_v = b["k_cache"].clone(), b["v_cache"].clone()
    torch_ops.store_kv(k, v, want_k, want_v, slots)
    built.store_kv(k, v, b["k_cache"], b["v_cache"], slots)
    same = torch.equal(b["k_cache"].nan_to_num(7), want_k.nan_to_num(7))  # unwritten slots hold NaN in both
    assert same and torch.equal(b["v_cache"].nan_to_num(7), want_v.nan_to_num(7))
    with pytest.raises(RuntimeError, match="out of range"):
        built.store_kv(k, v, b["k_cache"], b["v_cache"], slots + b["k_cache"].shape[0] * 16)


def test_padding_rows_are_zeros_and_other_head_sizes_fall_back(built):
    b = random_batch(4, 2, 64, 16, [(20, 1), (3, 1)], torch.float32)
    store(torch_ops, b)
    want = attend(built, b)
    pad = with_padding_rows(b, 2)
    got = attend(built, pad)
    assert torch.equal(got[:2], want) and torch.equal(got[2:], torch.zeros_like(got[2:]))

    too_long = dict(b, seq_lens=b["seq_lens"] + b["block_table"].shape[1] * 16)  # past its block table row
    with pytest.raises(RuntimeError, match="more than its block table row"):
        attend(built, too_long)

    odd = random_batch(4, 2, 24, 16, [(20, 1), (0, 5)], torch.float32)  # a head size the kernel is not built for
    assert 24 not in built.head_sizes()
    store(torch_ops, odd)
    assert torch.equal(attend(built, odd), attend(torch_ops, odd))


def test_auto_on_a_cpu_picks_the_kernel(built, tmp_path):
    for name in ("auto", "cpu"):
        backend = get_backend(name, "cpu", tmp_path)
        assert backend.name == "cpu" and backend.planned and backend.layers is cpu_ops and not backend.graph_safe
        assert backend.linear_paths == built.linear_paths() and backend.fallback is None


PROBE = """
import json, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from pagedq_kernels import get_backend, torch_ops
auto = get_backend("auto", "cpu", Path(sys.argv[1]))
try:
    get_backend("cpu", "cpu", Path(sys.argv[1]))
    explicit = "ok"
except ValueError as e:
    explicit = str(e)
print(json.dumps({"auto_is_torch": auto.name == "torch" and auto.fallback is not None, "explicit": explicit}))
"""


def probe(build_root: Path, **env: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(build_root)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


@pytest.mark.slow
def test_without_a_compiler_auto_falls_back_and_cpu_says_why(tmp_path):
    got, log = probe(tmp_path / "fresh", CXX="no-such-c++")
    assert got["auto_is_torch"] and "no C++ compiler ('no-such-c++')" in log
    assert "attention_backend='cpu' cannot run here" in got["explicit"] and "no-such-c++" in got["explicit"]


@pytest.mark.slow
def test_an_unwritable_cache_falls_back_too(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    got, log = probe(blocker / "kernels")  # mkdir under a file fails, as on a read-only cache
    assert got["auto_is_torch"] and "cannot build the CPU kernels in" in log
    assert "cannot run here" in got["explicit"]


def test_host_kv_cache_is_zeroed_and_outlives_its_mapping():
    import gc

    from engine.runner import host_memory

    cache = host_memory.zeros((2, 3, 5, 16, 2, 8), torch.bfloat16)
    assert cache.shape == (2, 3, 5, 16, 2, 8) and cache.dtype == torch.bfloat16 and not cache.any()
    layer = cache[1, 2]  # a view, as each layer holds, is all that is left of it
    del cache
    gc.collect()
    layer.fill_(1)
    assert layer.sum().item() == 5 * 16 * 2 * 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_and_rotary_round_as_torch_does(built, dtype):
    from engine.models.llama import RMSNorm, rotate

    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = torch.randn(576, generator=gen).to(dtype)
    x = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    want = norm(x)
    got = built.rms_norm(x, norm.weight, norm.eps)
    # The sum of squares is summed in another order: float32 within a few ulps, the others within one rounding.
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    heads = x.view(37, 9, 64)  # q/k norms: rows of a 3-D tensor
    torch.testing.assert_close(built.rms_norm(heads, norm.weight[:64], 1e-5),
                               RMSNorm(64, 1e-5).to(dtype).requires_grad_(False).eval()(heads) * norm.weight[:64],
                               atol=tol, rtol=tol)
    # A sublayer's output added to the residual stream and normed in one pass: the stream is torch's sum exactly.
    out = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    stream = x.clone()
    want_normed, want_stream = norm.add_and_norm(out, x)
    got = built.add_rms_norm(out, stream, norm.weight, norm.eps)
    assert torch.equal(stream, want_stream)
    torch.testing.assert_close(got, want_normed, atol=tol, rtol=tol)

    qkv = torch.randn(37, 15 * 64, generator=gen).to(dtype)
    q = qkv[:, : 9 * 64].view(37, 9, 64)  # a strided view, as the model rotates it
    positions = torch.randint(0, 100, (37,), generator=gen)
    cos, sin = torch.randn(100, 64, generator=gen), torch.randn(100, 64, generator=gen)
    want = rotate(q, cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None])
    assert built.rotary(q, positions, cos, sin) is q
    assert torch.equal(q, want)  # every product and sum rounded where torch rounds it: the same numbers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_and_mul_rounds_as_torch_does(built, dtype):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 2 * 1536, generator=gen) * 4).to(dtype)
    x[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, float("inf"), float("-inf"), float("nan"), 1e-30]).to(dtype)
    got, want = built.silu_and_mul(x), torch_ops.silu_and_mul(x)
    assert got.shape == want.shape == (37, 1536)
    if dtype != torch.bfloat16:  # float32 and float16 are torch's own
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        return
    # Another exp: the SiLU before its rounding differs in the last float32 bits, so a rare value rounds the other way.
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.float().mean() > 0.999 and torch.allclose(got, want, rtol=1e-2, atol=1e-6, equal_nan=True)
    narrow = x[1:, :40].contiguous()  # 20 values a half, not a multiple of 16: torch's
    assert torch.equal(built.silu_and_mul(narrow), torch_ops.silu_and_mul(narrow))


def _path(built, dtype: torch.dtype) -> str:
    """How this CPU multiplies dtype's panels; asserted against its flags, so a path is never skipped silently where
    the CPU has it."""
    flags = Path("/proc/cpuinfo").read_text().split("\n\n")[0].split()
    want = {torch.float32: "avx512" if "avx512f" in flags else "",
            torch.bfloat16: "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else ""}[dtype]
    got = built.linear_paths().get(str(dtype).removeprefix("torch."), "")
    assert got == want
    if not got:
        pytest.skip(f"no {dtype} panel path on this CPU (it lacks {'AVX-512' if dtype == torch.float32 else 'AVX512_BF16 and AMX'})")
    return got


TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2**-8, "atol": 1e-4}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 11, 12, 13, 15, 16, 17, 33, 300])  # tails of a register block, a tile, a pass
@pytest.mark.parametrize("k, n", [(32, 32), (64, 96), (96, 50), (576, 960)])  # 50: a panel's tail
def test_panel_linear_sums_as_a_float32_reference(built, dtype, rows, k, n):
    _path(built, dtype)
    gen = torch.Generator().manual_seed(rows * n)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, 2 * k, generator=gen).to(dtype)[:, k:]  # rows a stride apart
    want = x.double() @ w.double().T
    packed = built.panel_pack(w, gated=False)
    for b in (None, bias):
        got = built.panel_linear(x, packed, b, n, gated=False)
        assert got.dtype == dtype and got.shape == (rows, n)
        torch.testing.assert_close(got.double(), want + (0 if b is None else b.double()), **TOLERANCE[dtype])
    batched = built.panel_linear(x.reshape(1, rows, k), packed, None, n, gated=False)
    assert batched.shape == (1, rows, n)
    buffer = torch.full((rows + 3, n), float("nan"), dtype=dtype)
    into = built.panel_linear(x, packed, None, n, gated=False, out=buffer[:rows])
    assert into.data_ptr() == buffer.data_ptr() and torch.equal(into, batched[0])
    assert buffer[rows:].isnan().all()  # nothing written past the rows


@pytest.mark.parametrize("rows", [1, 20, 64])
def test_gated_panel_linear_is_silu_and_mul_of_the_projection(built, rows):
    _path(built, torch.bfloat16)
    gen = torch.Generator().manual_seed(rows)
    inter, k = 48, 64  # three 16-column panels of gate beside up
    w = (torch.randn(2 * inter, k, generator=gen) / 2).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    got = built.panel_linear(x, built.panel_pack(w, gated=True), None, 2 * inter, gated=True)
    want = torch_ops.silu_and_mul((x.float() @ w.float().T).bfloat16())
    assert got.shape == want.shape == (rows, inter)
    # The projection rounds as the reference's does but for a last float32 bit now and then: so may a value.
    assert (got == want).float().mean() > 0.97
    torch.testing.assert_close(got, want, rtol=2**-6, atol=1e-3)


def test_panel_linear_refuses_what_does_not_fit(built):
    with pytest.raises(RuntimeError, match="multiple of 32"):
        built.panel_pack(torch.zeros(32, 40, dtype=torch.bfloat16), gated=False)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        built.panel_pack(torch.zeros(2 * 24, 64, dtype=torch.bfloat16), gated=True)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        built.panel_pack(torch.zeros(32, 32, dtype=torch.float16), gated=False)
    _path(built, torch.float32)
    packed = built.panel_pack(torch.zeros(64, 64), gated=False)
    with pytest.raises(RuntimeError, match="another shape"):
        built.panel_linear(torch.zeros(3, 32), packed, None, 64, gated=False)
    with pytest.raises(RuntimeError, match="weight's dtype"):
        built.panel_linear(torch.zeros(3, 64, dtype=torch.bfloat16), packed, None, 64, gated=False)
    with pytest.raises(RuntimeError, match="contiguous"):
        built.panel_linear(torch.zeros(3, 64), packed, None, 64, gated=False, out=torch.zeros(64, 3).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_picks_torchs_first_maximum(built, dtype):
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(9, 1000 + 7, generator=gen)  # not a multiple of the vector width: a tail
    wide[1, 5] = wide[1, 900] = wide[1, 1003] = 50  # ties in different lanes and in the tail: the first wins
    wide[2, 17] = wide[2, 1] = 50  # a later vector before an earlier lane
    wide[3, 1006] = 60  # the maximum in the tail alone
    wide[4, 40], wide[4, 3] = float("nan"), float("nan")  # torch's max: the first NaN
    wide[5] = float("-inf")
    wide[6, 700] = float("inf")
    wide[7] = 0.0
    wide[8, ::2] = -0.0
    ties = torch.randint(-2, 2, (64, 33), generator=gen).float()  # many equal values per row
    for x in (wide, ties, wide[:, :16], wide[:, :15], wide[:, :1], wide[:, 3:500]):  # the last: strided rows
        x = x.to(dtype)
        assert torch.equal(built.argmax(x), torch_ops.argmax(x)), x.shape
    odd = torch.randn(4, 3, 8).to(dtype)  # not [rows, vocab]: the torch op answers
    assert torch.equal(built.argmax(odd), torch_ops.argmax(odd))
    assert torch.equal(built.argmax(wide.t()), torch_ops.argmax(wide.t()))  # rows not contiguous


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_on_the_cpu_kernels_matches_the_torch_ops(built, tiny_model, arch):
    from engine import EngineConfig, LLMEngine, SamplingParams

    prompts = [[5, 9, 200, 31] * 20, [7] * 3, list(range(40, 140))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "cpu"):
        engine = LLMEngine(EngineConfig(model=tiny_model(arch), attention_backend=backend, num_kv_blocks=64))
        assert (engine.runner.model.fast is built) == (backend == "cpu")
        outs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outs["cpu"] == outs["torch"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])  # qwen2: biased qkv; qwen3: q/k norms
def test_the_decoder_stack_in_one_call_equals_layer_by_layer(built, tiny_model, arch, dtype):
    from engine import EngineConfig, LLMEngine, SamplingParams

    # Prompts longer than a step's token budget (chunked prefill) beside decodes, greedy and seeded, with logprobs.
    prompts = [[5, 9, 200, 31] * 20, [7] * 3, list(range(40, 140))]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=20, temperature=0.8, seed=4, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)]
    outs = {}
    for whole in (True, False):
        engine = LLMEngine(EngineConfig(model=tiny_model(arch), dtype=dtype, num_kv_blocks=64,
                                        max_num_batched_tokens=48))
        model = engine.runner.model
        assert model.decoder is not None  # every part has a kernel here
        if not whole:
            model.decoder = None
        outs[whole] = [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)]
    assert outs[True] == outs[False]  # the same ops in the same order: the same numbers


def test_the_decoder_stack_stays_out_where_a_part_has_no_kernel(built, tiny_model):
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=16))
    model, backend = engine.runner.model, engine.runner.backend
    assert model.use_decoder(backend)
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(128, 64)  # a plain linear: no panels
    assert not model.use_decoder(backend) and model.decoder is None
    torch_backend = get_backend("torch", "cpu")
    assert not LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=16,
                                      attention_backend="torch")).runner.model.use_decoder(torch_backend)
