"""The torch attention ops against a plain dense reference, on mixed batches."""

import pytest
import torch

from pagedq_kernels import torch_ops


def reference(q, k_seqs, v_seqs, q_lens, scale):
    """Dense causal attention per sequence; k_seqs[b] holds all positions of sequence b."""
    out, start = [], 0
    for k, v, n in zip(k_seqs, v_seqs, q_lens):
        total = k.shape[0]
        group = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        qs = q[start : start + n]
        s = torch.einsum("qhd,khd->hqk", qs, kk) * scale
        pos = torch.arange(total - n, total)[:, None]
        s = s.masked_fill(torch.arange(total)[None, :] > pos, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_batch_matches_dense(hq, hkv, dtype):
    torch.manual_seed(0)
    d, bs, nblocks = 32, 4, 64
    # (cached tokens, new tokens): prefill, chunk after a cached prefix, decodes, a one-token prompt
    shapes = [(0, 9), (6, 5), (12, 1), (3, 1), (0, 1), (17, 1)]
    k_cache = torch.zeros(nblocks, bs, hkv, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(nblocks).tolist()
    tables, k_seqs, v_seqs, qs, slots = [], [], [], [], []
    for cached, new in shapes:
        total = cached + new
        blocks = [perm.pop() for _ in range(-(-total // bs))]
        tables.append(blocks)
        k = torch.randn(total, hkv, d, dtype=dtype)
        v = torch.randn(total, hkv, d, dtype=dtype)
        k_seqs.append(k.float())
        v_seqs.append(v.float())
        # the cached part is already in the cache; the new part goes through store_kv
        for p in range(cached):
            k_cache[blocks[p // bs], p % bs] = k[p]
            v_cache[blocks[p // bs], p % bs] = v[p]
        slots += [blocks[p // bs] * bs + p % bs for p in range(cached, total)]
        qs.append(torch.randn(new, hq, d, dtype=dtype))
    new_k = torch.cat([k[c:].to(dtype) for k, (c, _) in zip(k_seqs, shapes)])
    new_v = torch.cat([v[c:].to(dtype) for v, (c, _) in zip(v_seqs, shapes)])
    slot_mapping = torch.tensor(slots + [-1])  # a skipped slot at the end
    torch_ops.store_kv(torch.cat([new_k, new_k[:1]]), torch.cat([new_v, new_v[:1]]), k_cache, v_cache, slot_mapping)
    q = torch.cat(qs)
    width = max(map(len, tables))
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = [n for _, n in shapes]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in shapes], dtype=torch.int32)
    scale = d**-0.5
    out = torch_ops.paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_table, scale)
    ref = reference(q.float(), k_seqs, v_seqs, q_lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_copy_blocks_copies_whole_blocks_of_every_layer(backend, dtype):
    """Copy-on-write's op (issue 24): block pairs[0][i] into pairs[1][i], keys and values of every layer, nothing
    else touched; on each backend (the C++ path's memcpy, the Triton kernel)."""
    from pagedq_kernels import get_backend

    try:
        copy = get_backend(backend, "cpu").copy_blocks
    except (RuntimeError, ValueError) as e:
        pytest.skip(f"{backend} backend unavailable here: {e}")
    torch.manual_seed(0)
    cache = torch.randn(2, 3, 10, 4, 2, 16).to(dtype)  # [keys/values, layers, blocks, block size, heads, head dim]
    pairs = torch.tensor([[1, 7, 4], [2, 0, 9]], dtype=torch.int64)
    want = cache.clone()
    for src, dst in pairs.T.tolist():
        want[:, :, dst] = cache[:, :, src]
    copy(cache, pairs)
    torch.testing.assert_close(cache, want, rtol=0, atol=0)
    copy(cache, pairs[:, :0])  # no pairs: nothing to do
    torch.testing.assert_close(cache, want, rtol=0, atol=0)
