"""The Triton kernels (under TRITON_INTERPRET=1, set in conftest) against the torch oracle, and both on caches whose
unwritten slots hold NaN."""

import pytest
import torch

from pagedq_kernels import torch_ops, triton_ops
from pagedq_kernels.testing import attend, oracle, random_batch, with_padding_rows
from pagedq_kernels.testing import rel_err as _rel_err

DECODE = [(12, 1), (3, 1), (70, 1), (0, 1), (33, 1)]
PREFILL = [(0, 9), (0, 40), (0, 1), (0, 17)]
CHUNKED = [(32, 20), (48, 5), (20, 31)]  # a chunk behind a cached prefix (a prefix-cache hit, or a later chunk)
MIXED = [(0, 9), (6, 5), (12, 1), (3, 1), (0, 1), (40, 1), (16, 24)]
KINDS = {"decode": DECODE, "prefill": PREFILL, "chunked": CHUNKED, "mixed": MIXED}


def rel_err(out, ref):
    assert not ref.isnan().any()
    err = _rel_err(out, ref)
    assert err != float("inf"), "NaN or inf in the output"
    return err


TOL = {torch.float32: 1e-5, torch.float16: 2e-3}

# Each head layout, head size, block size, dtype and batch kind appears in several combinations.
CASES = [
    ((9, 3), 64, 16, torch.float32, "mixed"),
    ((9, 3), 64, 32, torch.float16, "decode"),
    ((9, 3), 128, 32, torch.float32, "chunked"),
    ((8, 2), 128, 16, torch.float16, "mixed"),
    ((8, 2), 64, 32, torch.float32, "prefill"),
    ((4, 4), 128, 32, torch.float32, "decode"),
    ((4, 4), 64, 16, torch.float16, "chunked"),
    ((5, 1), 64, 16, torch.float32, "chunked"),
    ((5, 1), 128, 32, torch.float16, "mixed"),
    ((32, 8), 64, 16, torch.float32, "decode"),
    ((32, 8), 128, 32, torch.float16, "prefill"),
    ((32, 8), 64, 16, torch.float16, "mixed"),
]


@pytest.mark.parametrize("heads, d, bs, dtype, kind", CASES)
def test_kernels_match_torch(heads, d, bs, dtype, kind):
    b = random_batch(*heads, d, bs, KINDS[kind], dtype)
    want_k, want_v = b["k_cache"].clone(), b["v_cache"].clone()
    torch_ops.store_kv(b["k"], b["v"], want_k, want_v, b["slot_mapping"])
    triton_ops.store_kv(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slot_mapping"])
    assert torch.equal(b["k_cache"].nan_to_num(7.0), want_k.nan_to_num(7.0))
    assert torch.equal(b["v_cache"].nan_to_num(7.0), want_v.nan_to_num(7.0))
    out = attend(triton_ops, b)
    assert out.dtype == dtype and out.shape == b["q"].shape
    assert rel_err(out, oracle(b)) < TOL[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("segments", [2, 5, 16])
def test_split_k_decode_matches_torch(segments):
    b = random_batch(8, 2, 64, 16, [(300, 1), (5, 1), (129, 1)], torch.float32)
    triton_ops.store_kv(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slot_mapping"])
    # Some segments of the short sequence are empty: they must add nothing.
    assert rel_err(attend(triton_ops, b, segments=segments), oracle(b)) < 1e-5


def test_split_k_is_for_decode_only():
    b = random_batch(4, 2, 64, 16, [(3, 4)], torch.float32)
    with pytest.raises(ValueError, match="decode-only"):
        attend(triton_ops, b, segments=2)


@pytest.mark.slow
def test_split_k_uses_no_more_segments_than_the_longest_context_fills():
    # Short contexts behind a wide block table (a graph's decode batch): the launch's segments come from shapes,
    # but only the first does work, and no merge reads the others' slots.
    b = random_batch(8, 2, 64, 16, [(40, 1), (5, 1), (90, 1)], torch.float32, num_blocks=2048)
    b["block_table"] = torch.cat([b["block_table"], b["block_table"].new_zeros(3, 1024)], dim=1)  # 16k tokens wide
    cap = triton_ops.num_segments(3, 2, b["block_table"].shape[1] * 16, torch.device("cpu"))
    assert cap > 1
    triton_ops.store_kv(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slot_mapping"])
    ws = triton_ops._workspace(3 * 8 * triton_ops.MAX_SEGMENTS, 64, torch.device("cpu"))
    for part in ws:
        part.fill_(float("nan"))
    assert rel_err(attend(triton_ops, b), oracle(b)) < 1e-5
    slots = ws[1][: 3 * 8 * triton_ops.MAX_SEGMENTS].view(3 * 8, triton_ops.MAX_SEGMENTS)
    assert not slots[:, 0].isnan().any() and slots[:, 1:].isnan().all()
    # The same batch with a long sequence in it splits again.
    long = random_batch(8, 2, 64, 16, [(40, 1), (1500, 1)], torch.float32, num_blocks=2048, seed=2)
    triton_ops.store_kv(long["k"], long["v"], long["k_cache"], long["v_cache"], long["slot_mapping"])
    for part in ws:
        part.fill_(float("nan"))
    assert rel_err(attend(triton_ops, long), oracle(long)) < 1e-5
    assert not ws[1][: 2 * 8 * triton_ops.MAX_SEGMENTS].view(16, -1)[:, 1].isnan().any()


@pytest.mark.slow
@pytest.mark.parametrize("segments", [3, 16])
def test_split_k_gives_padding_rows_zeros(segments):
    # A graph's padded decode batch with split-K: rows of length 0 read nothing and get zeros.
    b = random_batch(8, 2, 64, 16, [(600, 1), (7, 1)], torch.float32)
    triton_ops.store_kv(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slot_mapping"])
    pad = with_padding_rows(b, 3)
    got = attend(triton_ops, pad, segments=segments)
    assert rel_err(got[:2], oracle(b)) < 1e-5 and torch.equal(got[2:], torch.zeros_like(got[2:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_large_cache_with_block_ids_near_the_top(dtype):
    # 33,000 blocks, all used ones above 32,768, small other dims; long decodes take the automatic split-K path.
    shapes = [(700, 1), (1000, 1), (64, 1)]
    b = random_batch(4, 1, 32, 16, shapes, dtype, num_blocks=33_000, first_block=32_768)
    assert triton_ops.num_segments(3, 1, b["block_table"].shape[1] * 16, torch.device("cpu")) > 1
    triton_ops.store_kv(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slot_mapping"])
    assert rel_err(attend(triton_ops, b), oracle(b)) < TOL[dtype]
    # and a mixed batch over the same cache
    b = random_batch(4, 1, 32, 16, [(40, 30), (500, 1)], dtype, num_blocks=33_000, first_block=32_768, seed=1)
    triton_ops.store_kv(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slot_mapping"])
    assert rel_err(attend(triton_ops, b), oracle(b)) < TOL[dtype]


def dense(b):
    """Causal attention per sequence in float64 from the new and cached K/V: no cache, no paging."""
    out, bs = [], b["k_cache"].shape[1]
    starts = b["query_start_loc"].tolist()
    for i, total in enumerate(b["seq_lens"].tolist()):
        n = starts[i + 1] - starts[i]
        idx = torch.tensor([b["block_table"][i, p // bs] * bs + p % bs for p in range(total)])
        k = b["k_cache"].flatten(0, 1)[idx].double()
        v = b["v_cache"].flatten(0, 1)[idx].double()
        q = b["q"][starts[i] : starts[i + 1]].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * b["scale"]
        pos = torch.arange(total - n, total)[:, None]
        s = s.masked_fill(torch.arange(total)[None, :] > pos, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(out)


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unwritten_slots_never_leak(backend, fill):
    # A finished request left NaN/inf in the unused tail of blocks that others now own.
    ops = {"torch": torch_ops, "triton": triton_ops}[backend]
    b = random_batch(9, 3, 64, 16, MIXED + [(16, 1), (31, 1)], torch.float32, fill=fill)
    ops.store_kv(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slot_mapping"])
    out = attend(ops, b)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense(b), atol=1e-5, rtol=1e-5)


def test_store_kv_skips_padding_and_reads_strided_input():
    b = random_batch(4, 2, 64, 16, [(0, 5), (3, 2)], torch.float32, fill=0.0)
    # v as the model passes it: a view into a fused projection, strided in its first dimension
    fused = torch.randn(7, 3, 2, 64)
    k, v = fused[:, 1], fused[:, 2]
    slots = b["slot_mapping"].clone()
    slots[2] = -1
    want_k, want_v = b["k_cache"].clone(), b["v_cache"].clone()
    torch_ops.store_kv(k, v, want_k, want_v, slots)
    triton_ops.store_kv(k, v, b["k_cache"], b["v_cache"], slots)
    assert torch.equal(b["k_cache"], want_k) and torch.equal(b["v_cache"], want_v)


def test_empty_batches():
    b = random_batch(4, 2, 64, 16, [(3, 1)], torch.float32)
    triton_ops.store_kv(b["k"][:0], b["v"][:0], b["k_cache"], b["v_cache"], b["slot_mapping"][:0])
    out = triton_ops.paged_attention(b["q"][:0], b["k_cache"], b["v_cache"], b["query_start_loc"][:1],
                                     b["seq_lens"][:0], b["block_table"][:0], b["scale"])
    assert out.shape == (0, 4, 64)


def test_padding_rows_read_nothing():
    # CUDA-graph padding: rows with seq_len 0 (one dummy token each) get zeros, not NaN, and change nothing else.
    b = random_batch(8, 2, 64, 16, [(20, 1), (7, 1)], torch.float32)
    triton_ops.store_kv(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slot_mapping"])
    want = attend(triton_ops, b)
    pad = with_padding_rows(b, 2)
    got = attend(triton_ops, pad)
    assert torch.equal(got[:2], want) and torch.equal(got[2:], torch.zeros_like(got[2:]))


def test_backend_choice(monkeypatch):
    from pagedq_kernels import get_backend

    torch_backend = get_backend("torch", "cpu")  # "auto" on a CPU: tests/kernels/test_cpu_kernels.py
    assert torch_backend.paged_attention is torch_ops.paged_attention and not torch_backend.graph_safe
    triton = get_backend("triton", "cpu")  # the interpreter
    assert triton.paged_attention is triton_ops.paged_attention and triton.graph_safe and not triton.planned
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="cannot run here"):
        get_backend("triton", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            get_backend("auto", "cuda")


@pytest.mark.slow
def test_every_variant_compiles_for_hopper(tmp_path):
    # The interpreter accepts kernels that the compiler refuses; compile them for sm_90a as a launch specializes
    # them (no GPU needed), with the resource report: no variant may spill where the engine runs it.
    from compile_triton import compiled_for_hopper

    rows = compiled_for_hopper("attention", tmp_path)
    kinds = {(row["kernel"], row["dtype"], row["head_dim"]) for row in rows}
    assert {k for k, _, _ in kinds} == {"_store_kv_kernel", "_attention_kernel", "_merge_kernel",
                                        "_copy_blocks_kernel"}
    assert all(row["registers"] > 0 for row in rows)
    # The launch hints are in: the attention kernels' K/V loads are pipelined (cp.async), in shared memory.
    attention = [row for row in rows if row["kernel"] == "_attention_kernel"]
    assert len(attention) >= 3 * len({(row["dtype"], row["head_dim"]) for row in attention})
    assert all(row["cp_async"] and row["shared_bytes"] > 0 and row["hinted_args"] for row in attention)
    # At the head sizes of the supported models nothing spills; float32 runs smaller tiles for it (tiles_for).
    # bfloat16 at head_dim 256 is reported, not held.
    spilling = [row["variant"] for row in rows if (row["head_dim"] <= 128 or row["dtype"] == "fp32")
                and row["spill_stores"] + row["spill_loads"] > 0]
    assert not spilling, spilling
