"""AWQ and GPTQ safetensors checkpoints and int4 made at load (issue 26).

A tiny random Llama's linear weights are quantized here to 4-bit groups and packed in each format's documented
layout by packers of this file (written from the layout, not from the readers): the readers must give back exactly
the dequantized weights, and the engine must run each checkpoint as the same model with those float weights would
run, up to the kernel's int8 rounding of activations."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.weights import awq_gptq
from pagedq_kernels import quant_layout

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (method, group, sym, checkpoint_format, desc_act)
VARIANTS = {
    "awq-g64": ("awq", 64, False, None, False),
    "gptq-sym-g128": ("gptq", 128, True, "gptq", False),
    "gptq-asym-g32-v2": ("gptq", 32, False, "gptq_v2", False),
    "gptq-asym-g64-v1": ("gptq", 64, False, "gptq", False),  # the v1 quirk: zeros stored minus one
    "gptq-act-order": ("gptq", 32, False, "gptq", True),
    "gptq-per-channel": ("gptq", -1, True, "gptq", False),
}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's gemm packing: nibble i of a word holds column AWQ_ORDER[i]


def group_index(k: int, group: int, desc_act: bool, rng) -> np.ndarray:
    """The group of each input: k // group, or with act-order the groups of a random order of the inputs."""
    size = k if group == -1 else group
    g = np.arange(k) // size
    if desc_act:
        order = rng.permutation(k)
        g[order] = np.arange(k) // size
    return g


def quantize(w: np.ndarray, g_idx: np.ndarray, sym: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """w [N, K] to 4-bit groups -> q [N, K], float16 scales [N, G], zeros [N, G], and the exact dequantization."""
    groups = g_idx.max() + 1
    scale, zero = np.zeros((w.shape[0], groups), np.float16), np.zeros((w.shape[0], groups), np.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            scale[:, g], zero[:, g] = np.abs(cols).max(1) / 7.5, 8
        else:
            lo, hi = cols.min(1), cols.max(1)
            scale[:, g] = (hi - lo) / 15
            zero[:, g] = np.clip(np.rint(-lo / scale[:, g].astype(np.float32)), 0, 15)
    s = scale.astype(np.float32)[:, g_idx]
    q = np.clip(np.rint(w / s) + zero[:, g_idx], 0, 15).astype(np.int64)
    return q, scale, zero, s * (q - zero[:, g_idx]).astype(np.float32)


def words(values: np.ndarray) -> np.ndarray:
    """[..., 8] 4-bit values -> [...] int32, value i in bits 4i..4i+3."""
    out = np.zeros(values.shape[:-1], np.uint32)
    for i in range(8):
        out |= (values[..., i].astype(np.uint32) & 0xF) << np.uint32(4 * i)
    return out.view(np.int32)


def pack_awq(q, scale, zero) -> dict[str, np.ndarray]:
    """AutoAWQ gemm: qweight [K, N / 8] and qzeros [G, N / 8] packed along N in AWQ_ORDER, scales [G, N]."""
    def along_n(x: np.ndarray) -> np.ndarray:  # x [rows, N]
        return words(x.reshape(x.shape[0], -1, 8)[..., AWQ_ORDER])

    return {"qweight": along_n(q.T), "qzeros": along_n(zero.T), "scales": scale.T.copy()}


def pack_gptq(q, scale, zero, g_idx, v1: bool) -> dict[str, np.ndarray]:
    """GPTQ: qweight [K / 8, N] packed along K, qzeros [G, N / 8] along N (v1: zero - 1), scales [G, N], g_idx."""
    qt = q.T  # [K, N]
    qweight = words(qt.reshape(-1, 8, qt.shape[1]).transpose(0, 2, 1))
    z = zero.T - (1 if v1 else 0)
    return {"qweight": qweight, "qzeros": words(z.reshape(z.shape[0], -1, 8)), "scales": scale.T.copy(),
            "g_idx": g_idx.astype(np.int32)}


def quant_config(variant: str) -> dict:
    method, group, sym, fmt, desc_act = VARIANTS[variant]
    if method == "awq":
        return {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group, "zero_point": True}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": fmt}


def write_checkpoint(base: Path, out: Path, variant: str, seed: int = 0) -> Path:
    """`base` with its linears quantized as `variant` (out/quant), and the same model with their exact
    dequantizations as float weights (out/float)."""
    from safetensors.numpy import save_file
    from safetensors.torch import load_file

    method, group, sym, fmt, desc_act = VARIANTS[variant]
    rng = np.random.default_rng(seed)
    tensors = {k: v.numpy() for k, v in load_file(str(base / "model.safetensors")).items()}
    quant, floats = {}, {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] not in LINEARS or not name.endswith(".weight"):
            quant[name] = floats[name] = t
            continue
        g_idx = group_index(t.shape[1], group, desc_act, rng)
        q, scale, zero, exact = quantize(t, g_idx, sym)
        packed = pack_awq(q, scale, zero) if method == "awq" else pack_gptq(q, scale, zero, g_idx, fmt == "gptq")
        quant.update({f"{module}.{k}": v for k, v in packed.items()})
        floats[name] = exact
    for kind, state in (("quant", quant), ("float", floats)):
        folder = out / kind
        shutil.copytree(base, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "quant" / "config.json").read_text())
    config["quantization_config"] = quant_config(variant)
    (out / "quant" / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """bases(arch) -> a tiny random model of arch wide enough for groups of 128 (hidden 128, MLP 256)."""
    from bench.random_model import make_tiny_model

    def get(arch: str) -> Path:
        return Path(make_tiny_model(str(tmp_path_factory.getbasetemp() / f"base-{arch}"), arch,
                                    shape={"hidden_size": 128, "intermediate_size": 256}))

    return get


@pytest.fixture(scope="module")
def base(bases) -> Path:
    return bases("llama")


@pytest.fixture(scope="module")
def checkpoints(bases, tmp_path_factory):
    """checkpoints(variant, arch="llama") -> a folder with quant/ and float/ (write_checkpoint), made once."""
    made = {}

    def get(variant: str, arch: str = "llama") -> Path:
        if (variant, arch) not in made:
            made[variant, arch] = write_checkpoint(bases(arch), tmp_path_factory.mktemp(f"{variant}-{arch}"), variant)
        return made[variant, arch]

    return get


@pytest.fixture(scope="module")
def quant_path(quant_backend) -> str:
    """The quantized kernel's path on this CPU (the test skips, saying why, where there is none)."""
    return quant_backend.linear_paths["quantized"]


def engine(model, **kw):
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(model), num_kv_blocks=32, max_num_seqs=2, **kw))


def logits(eng, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32: one prefill of ids from an empty cache."""
    from engine.models.llama import AttnContext

    runner, n = eng.runner, len(ids)
    ctx = AttnContext(slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                      seq_lens=torch.tensor([n], dtype=torch.int32),
                      block_table=torch.arange(-(-n // runner.config.block_size), dtype=torch.int32)[None],
                      backend=runner.backend)
    with torch.inference_mode():
        return runner.model.logits(runner.model(torch.tensor(ids), torch.arange(n), ctx)).float()


def int8_rows(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x as the kernel sees it: per row and block of 32, dx * round(x * 127 / max |x|), dx = max |x| / 127."""
    rows = x.reshape(x.shape[0], -1, block)
    amax = rows.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(rows * inv) * (amax / 127)).reshape(x.shape)


PROMPT = [1, 17, 300, 4242, 9, 77, 1024, 5]


def assert_close_run(got, want, tol: float) -> None:
    """Logits within tol (relative, in norm); greedy tokens the same while the reference's margin between its best
    two exceeds twice the largest logit error."""
    from engine import SamplingParams

    a, b = logits(got, PROMPT), logits(want, PROMPT)
    assert (a - b).norm() <= tol * b.norm(), ((a - b).norm() / b.norm()).item()
    err = (a - b).abs().max().item()
    params = SamplingParams(max_tokens=8, temperature=0)
    ref = want.generate([PROMPT], params)[0].token_ids
    out = got.generate([PROMPT], params)[0].token_ids
    top = logits(want, PROMPT + ref[:-1])[len(PROMPT) - 1:].topk(2).values
    clear = (top[:, 0] - top[:, 1] > 2 * err).tolist()
    for i in range(len(ref)):
        if not clear[i]:
            break
        assert out[i] == ref[i], (i, out, ref)


@pytest.mark.parametrize("variant", VARIANTS)
def test_readers_give_the_exact_weights(variant):
    method, group, sym, fmt, desc_act = VARIANTS[variant]
    rng = np.random.default_rng(3)
    w = rng.standard_normal((48, 256)).astype(np.float32) * 0.05
    g_idx = group_index(256, group, desc_act, rng)
    q, scale, zero, exact = quantize(w, g_idx, sym)
    if method == "awq":
        p = pack_awq(q, scale, zero)
        groups = awq_gptq.read_awq(p["qweight"], p["qzeros"], p["scales"], group)
    else:
        p = pack_gptq(q, scale, zero, g_idx, fmt == "gptq")
        groups = awq_gptq.read_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], 4, group,
                                            fmt == "gptq")
    np.testing.assert_array_equal(groups.dequantize(), exact)
    blocks = groups.blocks()
    if desc_act:  # inputs of a block of 32 fall in different groups: no Blocks, the float path
        assert blocks is None
    else:
        assert (blocks.bits, blocks.block) == (4, 32)
        np.testing.assert_array_equal(blocks.dequantize(), exact)


def test_gptq_8_bit_and_missing_g_idx():
    rng = np.random.default_rng(4)
    q = rng.integers(0, 256, (16, 64))
    scale = (rng.random((16, 2)) * 0.01).astype(np.float16)
    zero = rng.integers(1, 256, (16, 2))
    qweight = np.zeros((16, 16), np.uint32)  # [K / 4, N]: 4 inputs a word
    for i in range(4):
        qweight |= q.T.reshape(16, 4, 16)[:, i].astype(np.uint32) << np.uint32(8 * i)
    qzeros = np.zeros((2, 4), np.uint32)
    for i in range(4):
        qzeros |= (zero.T - 1).reshape(2, 4, 4)[..., i].astype(np.uint32) << np.uint32(8 * i)
    groups = awq_gptq.read_gptq(qweight.view(np.int32), qzeros.view(np.int32), scale.T.copy(), None, 8, 32,
                                        True)
    g = np.arange(64) // 32
    want = scale.astype(np.float32)[:, g] * (q - zero[:, g]).astype(np.float32)
    np.testing.assert_array_equal(groups.blocks().dequantize(), want)
    assert groups.blocks().bits == 8


@pytest.mark.slow
@pytest.mark.parametrize("variant,arch", [
    ("awq-g64", "llama"), ("gptq-sym-g128", "llama"), ("gptq-asym-g32-v2", "llama"), ("gptq-asym-g64-v1", "llama"),
    ("gptq-per-channel", "llama"),
    ("awq-g64", "qwen2"),  # q/k/v biases beside the quantized weights
    ("gptq-asym-g64-v1", "qwen3"),  # q/k norms, head_dim apart from hidden / heads
])
def test_engine_runs_the_checkpoint_as_stored(checkpoints, quant_path, variant, arch):
    folder = checkpoints(variant, arch)
    got, want = engine(folder / "quant"), engine(folder / "float", quantization="none")
    name = {"awq-g64": "AWQ 4-bit g64", "gptq-per-channel": "GPTQ 4-bit per-channel"}.get(
        variant, f"GPTQ 4-bit g{VARIANTS[variant][1]}")
    kept = {r.name: (r.format, r.path) for r in got.runner.quantized}
    assert kept["model.layers.0.self_attn.qkv_proj"] == (name, quant_path)
    assert kept["lm_head"][1] == "float (not quantized in the checkpoint)"
    assert sum(p == quant_path for _, p in kept.values()) == 8  # 4 fused linears a layer, 2 layers
    assert got.runner.model.decoder is not None  # still the one-call C++ stack
    # A layer: the float layer on x rounded as the kernel rounds it, to float32 sums apart (exact weights).
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    layer = got.runner.model.model.layers[1].self_attn.qkv_proj
    torch.testing.assert_close(layer(x), want.runner.model.model.layers[1].self_attn.qkv_proj(int8_rows(x)),
                               rtol=1e-4, atol=1e-5)
    # The model: random tiny weights amplify the int8 rounding of activations (per channel int8 weights, which add
    # their own error, land at about 3% here).
    assert_close_run(got, want, tol=0.03)


def test_act_order_runs_dequantized_and_says_so(checkpoints, caplog):
    folder = checkpoints("gptq-act-order")
    with caplog.at_level("INFO", logger="pagedq.engine"):
        got = engine(folder / "quant")
    want = engine(folder / "float", quantization="none")
    paths = {r.path for r in got.runner.quantized}
    if paths:  # a CPU with the kernel: every quantized layer reported float, and why
        assert paths == {"float (GPTQ 4-bit g32 act-order: act-order groups do not fall on blocks of 32 inputs, "
                         "dequantized to float)", "float (not quantized in the checkpoint)"}
        assert "act-order" in caplog.text
    torch.testing.assert_close(logits(got, PROMPT), logits(want, PROMPT))  # the same float weights: the same run


def test_without_the_kernel_a_checkpoint_runs_dequantized(checkpoints, caplog):
    folder = checkpoints("awq-g64")
    with caplog.at_level("WARNING", logger="pagedq.engine"):
        got = engine(folder / "quant", attention_backend="torch")
    want = engine(folder / "float", quantization="none", attention_backend="torch")
    assert got.runner.quantized == []
    assert "AWQ 4-bit g64 weights dequantized to float" in caplog.text
    torch.testing.assert_close(logits(got, PROMPT), logits(want, PROMPT))


def test_models_layers_reports_the_format(checkpoints, quant_path):
    from click.testing import CliRunner

    from cli.model_files import layers

    result = CliRunner().invoke(layers, [str(checkpoints("gptq-sym-g128") / "quant")])
    assert result.exit_code == 0, result.output
    assert "GPTQ 4-bit g128" in result.output and "8 layers GPTQ 4-bit g128" in result.output


@pytest.mark.slow
def test_int4_at_load_runs_its_rounding_and_stays_near_float(bases, quant_path, tmp_path):
    """int4 made at load runs exactly its own rounding (the model with those weights as floats, up to the int8
    rounding of activations), and stays near the float model (random weights: the hardest case for 4 bits)."""
    from safetensors.numpy import load_file, save_file

    base = bases("qwen2")  # lm_head apart from the embedding: its int8 rounding can be written as floats
    state = load_file(str(base / "model.safetensors"))
    for name, w in state.items():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            make = quant_layout.int8_per_channel if name == "lm_head.weight" else quant_layout.int4_groups
            state[name] = make(w).dequantize()
    rounded = tmp_path / "rounded"
    shutil.copytree(base, rounded, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(state, str(rounded / "model.safetensors"), metadata={"format": "pt"})
    got = engine(base, quantization="int4")
    formats = {r.name: r.format for r in got.runner.quantized}
    assert formats.pop("lm_head") == "int8" and set(formats.values()) == {"int4"}  # 4-bit logits cost most
    assert_close_run(got, engine(rounded, quantization="none"), tol=0.03)
    a, b = logits(got, PROMPT), logits(engine(base, quantization="none"), PROMPT)
    assert (a - b).norm() <= 0.4 * b.norm()  # 0.27 here: gaussian weights lose ~8% each to 4 bits, 2 layers deep


def test_int4_groups_within_half_a_step():
    w = np.random.default_rng(5).standard_normal((8, 96)).astype(np.float32)
    w[2, :32] = 0.25  # a constant block: its min alone, exactly
    blocks = quant_layout.int4_groups(w)
    blocks_w = w.reshape(8, 3, 32)
    step = (blocks_w.max(2) - blocks_w.min(2)) / 15
    # the min rounded down and the scale up to float16s: a step at most a float16's rounding of each wider
    assert quant_layout.half_scales(blocks) and np.all(blocks.min <= blocks_w.min(2))
    assert np.all(blocks.scale <= (step + np.abs(blocks.min) * 2**-10 / 15) * (1 + 2**-10))
    err = np.abs(blocks.dequantize() - w).reshape(8, 3, 32)
    assert np.all(err <= blocks.scale[..., None] / 2 * (1 + 1e-5) + 1e-7)
    assert np.all(blocks.dequantize()[2, :32] == 0.25)


def test_int4_refused_with_tensor_parallelism():
    from engine import EngineConfig

    with pytest.raises(ValueError, match="int4 does not combine with tensor parallelism"):
        EngineConfig(quantization="int4", tensor_parallel_size=2)


@pytest.mark.parametrize("qc,field", [
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "bits 8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits 3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size"),
    ({"quant_method": "fp8"}, "quant_method 'fp8'"),
    ({"quant_method": "gptq", "group_size": 128}, "'bits'"),
])
def test_bad_configs_name_the_field(qc, field):
    from engine.weights.checkpoint import scheme

    with pytest.raises(ValueError, match=field):
        scheme(SimpleNamespace(quantization_config=qc))


@pytest.mark.slow
def test_bad_checkpoints_fail_clearly(checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(checkpoints("gptq-asym-g64-v1") / "quant", folder)
    with pytest.raises(ValueError, match="already: give quantization 'auto'"):
        engine(folder, quantization="int8")
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.1.mlp.down_proj.scales"] = state["model.layers.1.mlp.down_proj.scales"][:, :-8]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj.scales has shape \[4, 120\], expected \[4, 128\]"):
        engine(folder)
    del state["model.layers.1.mlp.down_proj.scales"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj.scales is missing"):
        engine(folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="a quantized checkpoint's tensor, but config.json has no quantization_config"):
        engine(folder)


def test_a_layer_quantized_in_part_runs_float(checkpoints, quant_path, tmp_path):
    """modules_to_not_convert may leave q_proj float beside quantized k/v: their stacked layer takes the float path."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "partial"
    shutil.copytree(checkpoints("awq-g64") / "quant", folder)
    state = load_file(str(folder / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    for suffix in ("qweight", "qzeros", "scales"):
        del state[f"{q}.{suffix}"]
    state[f"{q}.weight"] = load_file(str(checkpoints("awq-g64") / "float" / "model.safetensors"))[f"{q}.weight"]
    save_file(state, str(folder / "model.safetensors"))
    paths = {r.name: r.path for r in engine(folder).runner.quantized}
    assert paths["model.layers.0.self_attn.qkv_proj"] == ("float (AWQ 4-bit g64: only some of its parts are "
                                                          "quantized in the checkpoint, dequantized to float)")
    assert paths["model.layers.1.self_attn.qkv_proj"] == quant_path
