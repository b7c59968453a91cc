"""Random paged batches for checking the attention ops against each other (the tests and `pagedq gpu-check`)."""

from __future__ import annotations

import torch


def random_batch(hq: int, hkv: int, head_dim: int, block_size: int, shapes: list[tuple[int, int]],
                 dtype: torch.dtype, num_blocks: int | None = None, first_block: int = 0,
                 fill: float = float("nan"), seed: int = 0, device: str = "cpu") -> dict:
    """A paged batch over a cache whose unwritten slots hold `fill`. shapes: (cached tokens, new tokens) per
    sequence. Blocks are drawn shuffled from [first_block, num_blocks); the cached tokens' K/V are in the cache,
    the new tokens' K/V (`k`, `v`) are not stored yet (store them with `slot_mapping`). Keys are the arguments of
    store_kv and paged_attention."""
    gen = torch.Generator().manual_seed(seed)
    needed = sum(-(-(c + n) // block_size) for c, n in shapes)
    num_blocks = num_blocks or needed + 8
    k_cache = torch.full((num_blocks, block_size, hkv, head_dim), fill, dtype=dtype)
    v_cache = torch.full_like(k_cache, fill)
    free = (first_block + torch.randperm(num_blocks - first_block, generator=gen)).tolist()
    tables, slots, qs, new_k, new_v = [], [], [], [], []
    for cached, new in shapes:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(blocks)
        k = torch.randn(total, hkv, head_dim, generator=gen).to(dtype)
        v = torch.randn(total, hkv, head_dim, generator=gen).to(dtype)
        idx = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(total)])
        k_cache.view(-1, hkv, head_dim)[idx[:cached]] = k[:cached]
        v_cache.view(-1, hkv, head_dim)[idx[:cached]] = v[:cached]
        slots += idx[cached:].tolist()
        new_k.append(k[cached:])
        new_v.append(v[cached:])
        qs.append(torch.randn(new, hq, head_dim, generator=gen).to(dtype))
    width = max(map(len, tables)) + 1  # wider than needed, padded with block 0 (another sequence's block)
    q_lens = torch.tensor([n for _, n in shapes])
    batch = dict(
        q=torch.cat(qs), k=torch.cat(new_k), v=torch.cat(new_v), k_cache=k_cache, v_cache=v_cache,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32),
        seq_lens=torch.tensor([c + n for c, n in shapes], dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
    )
    batch = {k: t.to(device) for k, t in batch.items()}
    batch["scale"] = head_dim**-0.5
    return batch


def with_padding_rows(batch: dict, n: int) -> dict:
    """A decode-only batch with n more rows that see no key (seq_len 0, one dummy token each), as a padded
    CUDA-graph batch has: attention must give them zeros and leave the other rows as they were."""
    pad = dict(batch)
    rows = len(batch["seq_lens"]) + n
    pad["q"] = torch.cat([batch["q"], torch.randn(n, *batch["q"].shape[1:]).to(batch["q"])])
    pad["query_start_loc"] = torch.arange(rows + 1, dtype=torch.int32, device=batch["q"].device)
    pad["seq_lens"] = torch.cat([batch["seq_lens"], batch["seq_lens"].new_zeros(n)])
    table = batch["block_table"]
    pad["block_table"] = torch.cat([table, table.new_zeros(n, table.shape[1])])
    return pad


def attend(ops, batch: dict, **kw) -> torch.Tensor:
    """ops.paged_attention over a random_batch (kw: ops.attention's extra arguments, e.g. segments)."""
    args = (batch["q"], batch["k_cache"], batch["v_cache"], batch["query_start_loc"], batch["seq_lens"],
            batch["block_table"], batch["scale"])
    return ops.attention(*args, **kw) if kw else ops.paged_attention(*args)


def store(ops, batch: dict) -> None:
    ops.store_kv(batch["k"], batch["v"], batch["k_cache"], batch["v_cache"], batch["slot_mapping"])


def oracle(batch: dict) -> torch.Tensor:
    """The torch path in float32 on the same (upcast) values: the reference the kernels are held to."""
    from pagedq_kernels import torch_ops

    up = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in batch.items()}
    return attend(torch_ops, up)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute error over the largest reference magnitude; inf when out holds NaN or inf."""
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# ---- host-side oracles that share nothing with the ops under test (pagedq gpu-check) ----


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a floating tensor as integers of the same width: equal bits compare equal, NaN included."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def new_token_slots(batch: dict) -> list[tuple[int, int, int]]:
    """(row of k/v, block, offset) for every new token of a paged batch, from its block table, query starts and
    sequence lengths alone (not its slot_mapping): sequence b's i-th new token sits at position
    seq_lens[b] - q_len_b + i, in block block_table[b, position // block_size]."""
    bs = batch["k_cache"].shape[1]
    starts = batch["query_start_loc"].tolist()
    table = batch["block_table"].tolist()
    out = []
    for b, total in enumerate(batch["seq_lens"].tolist()):
        n = starts[b + 1] - starts[b]
        for i in range(n):
            pos = total - n + i
            out.append((starts[b] + i, table[b][pos // bs], pos % bs))
    return out


def expected_caches(before: tuple[torch.Tensor, torch.Tensor], batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches on the host as store_kv must leave them: `before` (host copies taken before the store, not views
    of the caches) with every new token's k and v written where new_token_slots puts it, and nothing else changed."""
    k_cache, v_cache = before[0].clone(), before[1].clone()
    k, v = batch["k"].cpu().to(k_cache.dtype), batch["v"].cpu().to(v_cache.dtype)
    for row, block, offset in new_token_slots(batch):
        k_cache[block, offset] = k[row]
        v_cache[block, offset] = v[row]
    return k_cache, v_cache


def dense_attention(batch: dict, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Causal attention per sequence on the host in float64, each sequence's keys gathered through its block table
    (from k_cache/v_cache when given, e.g. expected_caches' result, else the batch's own). A row with nothing to
    see (a padding row: seq_len 0) gets zeros. -> [T, Hq, D] float64 on the host."""
    k_cache = (batch["k_cache"] if k_cache is None else k_cache).cpu()
    v_cache = (batch["v_cache"] if v_cache is None else v_cache).cpu()
    q = batch["q"].cpu().double()
    bs = k_cache.shape[1]
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    table = batch["block_table"].cpu().long()
    starts = batch["query_start_loc"].tolist()
    out = torch.zeros_like(q)
    for b, total in enumerate(batch["seq_lens"].tolist()):
        s, e = starts[b], starts[b + 1]
        if total == 0 or s == e:
            continue
        pos = torch.arange(total)
        idx = table[b, pos // bs] * bs + pos % bs
        k, v = flat_k[idx].double(), flat_v[idx].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k) * batch["scale"]
        q_pos = torch.arange(total - (e - s), total)[:, None]
        scores = scores.masked_fill(pos[None, :] > q_pos, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
