"""Paged attention in plain torch: the CPU inference path and the test oracle for the Triton kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The ops read lengths on the host (.tolist()): a CUDA graph cannot capture them.
GRAPH_SAFE = False


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


# Decode rows are attended in groups of about this many cached tokens: a group's gathered keys and values then
# stay in the CPU caches, and longer sequences are not padded to the longest of the whole batch.
GROUP_TOKENS = 4096


def _decode(q, k_cache, v_cache, decode, starts, lens, block_table, scale, out) -> None:
    """One-token queries, grouped by cache length; per KV head a strided bmm, so no copy besides the gather."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    order = sorted(decode, key=lens.__getitem__)
    i = 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j - i + 1) * lens[order[j]] <= GROUP_TOKENS:
            j += 1
        seqs = order[i:j]
        i = j
        n = len(seqs)
        n_blocks = -(-lens[seqs[-1]] // block_size)
        idx = torch.tensor(seqs, device=q.device)
        rows = torch.tensor([starts[b] for b in seqs], device=q.device)
        blocks = block_table[idx, :n_blocks].long().flatten()
        k = k_cache.index_select(0, blocks).view(n, n_blocks * block_size, num_kv_heads, head_dim)
        v = v_cache.index_select(0, blocks).view(n, n_blocks * block_size, num_kv_heads, head_dim)
        qg = q[rows].view(n, num_kv_heads, group, head_dim)
        lens_t = torch.tensor([lens[b] for b in seqs], device=q.device)
        pad = (torch.arange(k.shape[1], device=q.device)[None, :] >= lens_t[:, None])[:, None, :]
        # Slots past a sequence's end may hold anything a finished request left there (blocks are reused
        # unwritten), NaN or inf included; 0 * NaN is NaN, so zero them rather than trust a 0 probability.
        # Rows are sorted by length, so only the part past the shortest one can hold such slots.
        shortest = lens[seqs[0]]
        empty = shortest == 0
        v[:, shortest:].masked_fill_(pad[:, 0, shortest:, None, None], 0)
        o = torch.empty(n, num_kv_heads, group, head_dim, dtype=q.dtype, device=q.device)
        for h in range(num_kv_heads):
            kh = k[:, :, h].to(q.dtype)
            scores = torch.bmm(qg[:, h], kh.transpose(1, 2)).float().mul_(scale)
            probs = torch.softmax(scores.masked_fill_(pad, float("-inf")), dim=-1).to(q.dtype)
            if empty:  # padding rows of a padded decode batch see no key: zeros, not 0/0
                probs.nan_to_num_(0.0)
            o[:, h] = torch.bmm(probs, v[:, :, h].to(q.dtype))
        out[rows] = o.view(n, num_kv_heads * group, head_dim)


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
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]

    decode = [b for b, n in enumerate(q_lens) if n == 1]
    if decode:
        _decode(q, k_cache, v_cache, decode, starts, lens, block_table, scale, out)

    for b, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        start, total = starts[b], lens[b]
        blocks = block_table[b, : -(-total // block_size)].long()
        k = _gather(k_cache, blocks)[:total].to(q.dtype)  # [L, Hkv, D]
        v = _gather(v_cache, blocks)[:total].to(q.dtype)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        qs = q[start : start + q_len].transpose(0, 1)  # [Hq, q_len, D]
        if total == q_len:
            o = F.scaled_dot_product_attention(qs, k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale)
        else:
            # Bottom-right aligned causal mask: earlier positions are already in the cache.
            pos = torch.arange(total - q_len, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= pos[:, None]
            o = F.scaled_dot_product_attention(qs, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale)
        out[start : start + q_len] = o.transpose(0, 1)
    return out
