"""Paged attention in plain torch: the CPU inference path and the test oracle for the Triton kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum: the greedy tokens of [rows, vocab] logits. max's CPU kernel is about 1.5x
    faster than argmax's over a large vocabulary, and gives the same index."""
    return logits.max(dim=-1).indices


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] on its last dimension (a fused gate/up projection's output)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def copy_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy whole KV blocks within the cache, every layer's keys and values at once: kv_cache [2, layers, blocks,
    ...], pairs [2, P] int64, block pairs[0][i] into block pairs[1][i] (copy-on-write of a block that forked
    continuations share). One gather and one scatter however many blocks and layers."""
    if pairs.shape[1]:
        kv_cache[:, :, pairs[1]] = kv_cache[:, :, pairs[0]]


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [T, Hkv, D] into the caches at flat slots (block * block_size + offset); slot -1 is skipped."""
    if slot_mapping.numel() == 0:
        return
    if int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, k.to(flat_k.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(flat_v.dtype))


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks [..., n] of a cache -> [..., n * block_size, Hkv, D]."""
    g = cache[blocks]
    return g.view(*blocks.shape[:-1], -1, *cache.shape[2:])


# Decode rows are attended in groups sorted by cache length, each padded to its longest row: a group grows while
# the padding stays under a third of what it gathers (longer sequences are not padded to the longest of the whole
# batch) and its gathered keys and values stay within a few MB.
GROUP_TOKENS = 16384
MAX_PADDING = 1 / 3


def _groups(order: list[int], lens: list[int]) -> list[list[int]]:
    groups, i = [], 0
    while i < len(order):
        j, used = i + 1, lens[order[i]]
        while j < len(order):
            padded = (j - i + 1) * lens[order[j]]
            if padded > GROUP_TOKENS or padded - (used + lens[order[j]]) > MAX_PADDING * padded:
                break
            used += lens[order[j]]
            j += 1
        groups.append(order[i:j])
        i = j
    return groups


def decode(q, k_cache, v_cache, decoding, starts, lens, block_table, scale, out) -> None:
    """One-token queries. The query heads that share a KV head are that head's queries (no key is repeated), so
    one fused attention call serves a whole group; the only copy is the gather of its blocks."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    for seqs in _groups(sorted(decoding, key=lens.__getitem__), lens):
        n = len(seqs)
        n_blocks = -(-lens[seqs[-1]] // block_size)
        idx = torch.tensor(seqs, device=q.device)
        rows = torch.tensor([starts[b] for b in seqs], device=q.device)
        blocks = block_table[idx, :n_blocks].long().flatten()
        k = k_cache.index_select(0, blocks).view(n, n_blocks * block_size, num_kv_heads, head_dim)
        v = v_cache.index_select(0, blocks).view(n, n_blocks * block_size, num_kv_heads, head_dim)
        lens_t = torch.tensor([lens[b] for b in seqs], device=q.device)
        keep = torch.arange(k.shape[1], device=q.device)[None, :] < lens_t[:, None]
        # Slots past a sequence's end may hold anything a finished request left there (blocks are reused
        # unwritten), NaN or inf included, and a masked NaN still poisons a fused softmax (0 * NaN is NaN): zero
        # them, touching those slots only.
        if lens[seqs[0]] < k.shape[1]:
            pad = (~keep).flatten().nonzero().squeeze(1)
            k.view(-1, num_kv_heads, head_dim).index_fill_(0, pad, 0)
            v.view(-1, num_kv_heads, head_dim).index_fill_(0, pad, 0)
        qg = q[rows].view(n, num_kv_heads, group, head_dim).to(k.dtype)
        o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep[:, None, None, :],
                                           scale=scale)
        if lens[seqs[0]] == 0:  # padding rows of a padded decode batch see no key: zeros, not 0/0
            o = o.nan_to_num(0.0)
        out[rows] = o.reshape(n, num_kv_heads * group, head_dim).to(out.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D] holds the new tokens of B sequences back to back -> out [T, Hq, D].

    The i-th new token of sequence b sits at position seq_lens[b] - q_len_b + i and sees positions up to its own.
    """
    out = torch.empty_like(q)
    starts, lens, q_lens = split(query_start_loc, seq_lens)
    decoding = [b for b, n in enumerate(q_lens) if n == 1]
    if decoding:
        decode(q, k_cache, v_cache, decoding, starts, lens, block_table, scale, out)
    prefill(q, k_cache, v_cache, starts, lens, q_lens, block_table, scale, out)
    return out


def split(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """On the host: each sequence's first query row, its length in the cache and its number of new tokens."""
    starts = query_start_loc.tolist()
    return starts, seq_lens.tolist(), [b - a for a, b in zip(starts[:-1], starts[1:])]


def prefill(q, k_cache, v_cache, starts, lens, q_lens, block_table, scale, out) -> None:
    """The sequences with more than one new token, each on its own, causal within its new tokens."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    for b, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        start, total = starts[b], lens[b]
        blocks = block_table[b, : -(-total // block_size)].long()
        # Query heads [Hkv, group, q_len, D] against keys expanded (stride 0, no copy) to [Hkv, group, L, D]: no
        # key or value is repeated per query head, and with equal batch shapes torch picks its fused CPU kernel
        # (a broadcast or enable_gqa falls back to the unfused path, several times slower).
        k = _gather(k_cache, blocks)[:total].to(q.dtype).transpose(0, 1)[:, None].expand(-1, group, -1, -1)
        v = _gather(v_cache, blocks)[:total].to(q.dtype).transpose(0, 1)[:, None].expand(-1, group, -1, -1)
        qs = q[start : start + q_len].view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        if total == q_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
        else:
            # Bottom-right aligned causal mask: earlier positions are already in the cache.
            pos = torch.arange(total - q_len, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= pos[:, None]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[start : start + q_len] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)
