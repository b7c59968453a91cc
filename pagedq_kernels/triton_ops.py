"""Paged attention in Triton: the CUDA path. Same two functions, same signatures, as kernels.torch_ops.

`paged_attention` is one kernel for a flat varlen batch (decode rows, prefill chunks, chunks behind a cached prefix,
all mixed). A program owns one KV head and a tile of query rows: the GROUP query heads that share the KV head times
up to BLOCK_Q tokens of one sequence, packed into the M dimension (M >= 16), so both products run on tensor cores
and each K/V tile read from the cache serves every head of the group. K and V are read in place through the block
table, with an online softmax. Decode-only batches over long contexts also split each sequence's context into
segments (split-K) whose partial results a second kernel merges by log-sum-exp.

Launch choices depend on shapes only (token count, batch size, block-table width), never on tensor contents: no
host sync, and a batch that changes never recompiles (the constexprs are model shape, block size and dtype; the
kernel has three variants at most: mixed, decode, decode with split-K). So a CUDA graph can capture both ops
(kernels.get_backend says so: graph_safe).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Rows of the online-softmax state start here instead of -inf, so that a row that sees no key at all (a padding
# row, an empty split-K segment) computes exp2(-inf - NEG) = 0 and never -inf - -inf = NaN.
NEG = tl.constexpr(-1.0e30)
# Split-K partials per (token, head) in the workspace; the launch picks at most this many segments.
MAX_SEGMENTS = 16
# A split-K segment is worth its merge only above this many context tokens.
MIN_SEGMENT_TOKENS = 256
LENS_TILE = tl.constexpr(128)  # sequence lengths read per step of _longest


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a padding row
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    # int64 throughout: block * stride overflows int32 in a large cache.
    block = slot // BLOCK_SIZE
    within = slot % BLOCK_SIZE
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=ok)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=ok)
    kdst = block * stride_kcb + within * stride_kcs + offs_h[:, None].to(tl.int64) * stride_kch + offs_d[None, :]
    vdst = block * stride_vcb + within * stride_vcs + offs_h[:, None].to(tl.int64) * stride_vch + offs_d[None, :]
    tl.store(kc_ptr + kdst, k.to(kc_ptr.dtype.element_ty), mask=ok)
    tl.store(vc_ptr + vdst, v.to(vc_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The sequence whose query tiles hold tile `pid`: sequence b's tiles start at qsl[b] // BLOCK_Q + b, a
    monotonic function of b, so a binary search finds it (a gap tile past a sequence's last maps to it too)."""
    lo = pid * 0
    hi = lo + num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _longest(lens_ptr, num_seqs):
    """The batch's longest sequence (tokens in the cache)."""
    longest = tl.load(lens_ptr) * 0
    for start in range(0, num_seqs, LENS_TILE):
        offs = start + tl.arange(0, LENS_TILE)
        longest = tl.maximum(longest, tl.max(tl.load(lens_ptr + offs, mask=offs < num_seqs, other=0), 0))
    return longest


@triton.jit
def _active_segments(lens_ptr, num_seqs, num_segments, min_segment_tokens):
    """Split-K segments this step uses: at most the launch's (shapes alone chose those, so that a CUDA graph keeps
    its grid), and no more than the batch's longest context fills at min_segment_tokens each. Read from the lengths
    on the device, so a graph replayed over short contexts splits them no further than they need."""
    return tl.minimum(num_segments, tl.maximum(1, _longest(lens_ptr, num_seqs) // min_segment_tokens))


@triton.jit(do_not_specialize=["num_seqs", "num_segments", "min_segment_tokens", "table_stride"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr,
    qsl_ptr, lens_ptr, table_ptr,
    scale_log2, num_seqs, num_segments, min_segment_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    table_stride,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SEGMENTS_CAP: tl.constexpr, DECODE: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seg = tl.program_id(2)
    if DECODE:
        # One new token per sequence: tile i is sequence i.
        seq = pid
        tile = pid * 0
    else:
        seq = _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q)
        tile = pid - (tl.load(qsl_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(lens_ptr + seq)
    cached = seq_len - q_len

    # Row m of the tile: token m // GROUP of the tile, query head m % GROUP of this KV head's group.
    offs_m = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    # A row that is not real sees no position at all.
    q_pos = tl.where(row_ok, cached + tok, -1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    t64 = (q_start + tok).to(tl.int64)
    q_off = t64[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys this tile can see end at its last token's position; split-K gives each segment a run of KV tiles.
    kv_end = cached + tl.minimum((tile + 1) * BLOCK_Q, q_len)
    n_tiles = tl.cdiv(kv_end, BLOCK_N)
    active = 1
    if SPLIT:
        active = _active_segments(lens_ptr, num_seqs, num_segments, min_segment_tokens)
        if seg >= active:  # a segment this step does not use: the merge never reads its slot
            return
    per_seg = tl.cdiv(n_tiles, active)
    lo = seg * per_seg
    hi = tl.minimum(lo + per_seg, n_tiles)

    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table_row = table_ptr + seq.to(tl.int64) * table_stride
    kvh64 = kvh.to(tl.int64)
    for j in range(lo, hi):
        pos = j * BLOCK_N + offs_n
        pos_ok = pos < kv_end
        # Positions past the sequence are never loaded: its last block's unwritten slots may hold anything.
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        within = (pos % BLOCK_SIZE).to(tl.int64)
        k_off = block * stride_kb + within * stride_ks + kvh64 * stride_kh
        v_off = block * stride_vb + within * stride_vs + kvh64 * stride_vh
        k_t = tl.load(k_ptr + k_off[None, :] + offs_d[:, None], mask=pos_ok[None, :] & d_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, k_t, input_precision="ieee")
        else:
            s = tl.dot(q, k_t)
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.where(pos_ok[:, None], v, 0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if SPLIT:
        base = (t64 * NUM_HEADS + head) * SEGMENTS_CAP + seg
        tl.store(ws_m_ptr + base, m_i, mask=row_ok)
        tl.store(ws_l_ptr + base, l_i, mask=row_ok)
        tl.store(ws_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = t64[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_seqs", "num_segments", "min_segment_tokens"])
def _merge_kernel(
    ws_acc_ptr, ws_m_ptr, ws_l_ptr, out_ptr, lens_ptr, num_seqs, num_segments, min_segment_tokens,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SEGMENTS_CAP: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, SEGMENTS_CAP)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < _active_segments(lens_ptr, num_seqs, num_segments, min_segment_tokens)
    d_ok = offs_d < HEAD_DIM
    base = (t * NUM_HEADS + h) * SEGMENTS_CAP + offs_s
    m = tl.load(ws_m_ptr + base, mask=s_ok, other=NEG)
    l_seg = tl.load(ws_l_ptr + base, mask=s_ok, other=0.0)
    acc = tl.load(ws_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)
    w = tl.where(s_ok, tl.exp2(m - tl.max(m, 0)), 0.0)
    total = tl.sum(w * l_seg, 0)
    o = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _copy_blocks_kernel(cache_ptr, pairs_ptr, num_pairs, blocks_per_plane, block_elems, CHUNK: tl.constexpr):
    """Program (pair, plane): block pairs[0][pair] into pairs[1][pair] in one layer's keys or values."""
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    src = tl.load(pairs_ptr + pair)
    dst = tl.load(pairs_ptr + num_pairs + pair)
    base = plane * blocks_per_plane * block_elems
    for start in range(0, block_elems, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ok = offs < block_elems
        x = tl.load(cache_ptr + base + src * block_elems + offs, mask=ok)
        tl.store(cache_ptr + base + dst * block_elems + offs, x, mask=ok)


def copy_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """pagedq_kernels.torch_ops.copy_blocks's contract: one launch for every block, layer and keys or values."""
    num_pairs = pairs.shape[1]
    if num_pairs == 0:
        return
    planes = kv_cache.shape[0] * kv_cache.shape[1]
    _copy_blocks_kernel[(num_pairs, planes)](kv_cache, pairs.contiguous(), num_pairs, kv_cache.shape[2],
                                             kv_cache.stride(2), CHUNK=1024)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [T, Hkv, D] into the caches at flat slots (block * block_size + offset); slot -1 is skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_dense(k), _last_dim_dense(v)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=_block_d(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )


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
    num_tokens, num_seqs = q.shape[0], block_table.shape[0]
    segments = 1
    if num_tokens == num_seqs > 0:  # every sequence brings one token (each brings at least one): decode only
        segments = num_segments(num_seqs, k_cache.shape[2], block_table.shape[1] * k_cache.shape[1], q.device)
    return attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, segments,
                     MIN_SEGMENT_TOKENS)


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    segments: int = 1,
    min_segment_tokens: int = 1,
) -> torch.Tensor:
    """paged_attention with the split-K segment count chosen by the caller (> 1 only for decode-only batches): the
    launch's; each step uses as many of them as the batch's longest context fills at min_segment_tokens each (1: as
    many as it has tokens, so a caller's count holds)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = block_table.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = _last_dim_dense(q)
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    decode = num_tokens == num_seqs
    if not decode and segments != 1:
        raise ValueError("split-K is for decode-only batches (one new token per sequence)")
    segments = max(1, min(int(segments), MAX_SEGMENTS))
    split = segments > 1
    block_m, block_q, block_n, block_d = tiles_for(group, head_dim, decode, q.dtype == torch.float32)
    tiles = num_seqs if decode else num_tokens // block_q + num_seqs
    if split:
        ws_acc, ws_m, ws_l = _workspace(num_tokens * num_heads * MAX_SEGMENTS, head_dim, q.device)
    else:
        ws_acc = ws_m = ws_l = out  # never touched
    _attention_kernel[(tiles, num_kv_heads, segments)](
        q, k_cache, v_cache, out, ws_acc, ws_m, ws_l,
        query_start_loc, seq_lens, block_table,
        scale * 1.4426950408889634, num_seqs, segments, min_segment_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, SEGMENTS_CAP=MAX_SEGMENTS,
        DECODE=decode, SPLIT=split, IEEE=q.dtype == torch.float32,
        num_warps=4,
    )
    if split:
        _merge_kernel[(num_tokens, num_heads)](
            ws_acc, ws_m, ws_l, out, seq_lens, num_seqs, segments, min_segment_tokens, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, SEGMENTS_CAP=MAX_SEGMENTS,
        )
    return out


def tiles_for(group: int, head_dim: int, decode: bool, wide: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N, BLOCK_D) of the attention kernel: rows of a query tile, tokens in it, keys per
    step, padded head size. Decode tiles hold one token, so M is the group padded to 16, tl.dot's minimum; mixed
    tiles hold as many tokens as fit in 64 rows. Every tl.dot dimension is >= 16, as Hopper requires. wide: float32
    elements, twice a half's registers: half the rows and keys per tile (a quarter of the rows past head size 128),
    or the kernel spills (the compile report)."""
    block_d = _block_d(head_dim)
    rows = 16 if decode else 64 // (1 + wide) // (1 + (wide and block_d > 128))
    block_m = max(rows, triton.next_power_of_2(group))
    block_n = (64 if block_d <= 64 else 32) // (1 + wide)
    return block_m, 1 if decode else block_m // group, max(16, block_n), block_d


def num_segments(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Split-K segments a decode batch launches with, from shapes only: enough programs to fill the GPU twice over,
    each segment at least MIN_SEGMENT_TOKENS of the longest possible context (the block table's width). The kernel
    then uses no more of them than the batch's longest context fills (_active_segments)."""
    programs = max(1, num_seqs * num_kv_heads)
    want = -(-2 * _num_sms(device) // programs)
    fits = max(1, max_context // MIN_SEGMENT_TOKENS)
    return max(1, min(want, fits, MAX_SEGMENTS))


_sms: dict[str, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100/H200's count, so the interpreter takes the same launch decisions
    key = str(device)
    if key not in _sms:
        _sms[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sms[key]


# Split-K workspaces by device, grown by doubling and never freed: a captured CUDA graph keeps the address it
# saw, so a buffer must outlive every graph that used it.
_workspaces: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}


def _workspace(rows: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kept = _workspaces.setdefault(str(device), [])
    if not kept or kept[-1][1].numel() < rows or kept[-1][0].numel() < rows * head_dim:
        n = max(rows, 2 * kept[-1][1].numel() if kept else 0)
        kept.append((torch.empty(n * head_dim, dtype=torch.float32, device=device),
                     torch.empty(n, dtype=torch.float32, device=device),
                     torch.empty(n, dtype=torch.float32, device=device)))
    return kept[-1]


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def runnable(device: str) -> str | None:
    """None when the kernels can run on `device`, else why not."""
    if device.startswith("cuda"):
        return None if torch.cuda.is_available() else "CUDA is not available"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for the interpreter), not {device!r}"
