"""The C++ decode attention of the CPU path (kernels/cpu_attention.cpp, built on first use) against the torch ops,
and how a backend is chosen on a CPU with and without a compiler."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_ops, get_backend, torch_ops
from kernels.testing import attend, oracle, random_batch, rel_err, store

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    why = cpu_ops.load(tmp_path_factory.mktemp("kernels"))
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
    prefill = torch.ones(len(got), dtype=torch.bool)
    prefill[rows] = False
    assert torch.equal(got[prefill], want[prefill])  # the prefill rows are the torch ops' own


def test_padding_rows_are_zeros_and_other_head_sizes_fall_back(built):
    b = random_batch(4, 2, 64, 16, [(20, 1), (3, 1)], torch.float32)
    store(torch_ops, b)
    want = attend(built, b)
    pad = dict(b)  # a padded decode batch (CUDA-graph style): two more rows that see no key
    pad["q"] = torch.cat([b["q"], torch.randn(2, 4, 64)])
    pad["query_start_loc"] = torch.arange(5, dtype=torch.int32)
    pad["seq_lens"] = torch.cat([b["seq_lens"], torch.zeros(2, dtype=torch.int32)])
    pad["block_table"] = torch.cat([b["block_table"], torch.zeros(2, b["block_table"].shape[1], dtype=torch.int32)])
    got = attend(built, pad)
    assert torch.equal(got[:2], want) and torch.equal(got[2:], torch.zeros_like(got[2:]))

    odd = random_batch(4, 2, 24, 16, [(20, 1), (0, 5)], torch.float32)  # a head size the kernel is not built for
    assert 24 not in built.head_sizes()
    store(torch_ops, odd)
    assert torch.equal(attend(built, odd), attend(torch_ops, odd))


def test_auto_on_a_cpu_picks_the_kernel(built, tmp_path):
    assert get_backend("auto", "cpu", tmp_path) is cpu_ops
    assert get_backend("cpu", "cpu", tmp_path) is cpu_ops


PROBE = """
import json, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from kernels import get_backend, torch_ops
auto = get_backend("auto", "cpu", Path(sys.argv[1]))
try:
    get_backend("cpu", "cpu", Path(sys.argv[1]))
    explicit = "ok"
except ValueError as e:
    explicit = str(e)
print(json.dumps({"auto_is_torch": auto is torch_ops, "explicit": explicit}))
"""


def test_without_a_compiler_auto_falls_back_and_cpu_says_why(tmp_path):
    env = {**os.environ, "CXX": "no-such-c++", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "fresh")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["auto_is_torch"] and "no C++ compiler ('no-such-c++')" in out.stderr
    assert "attention_backend='cpu' cannot run here" in got["explicit"] and "no-such-c++" in got["explicit"]


def test_host_kv_cache_is_zeroed_and_outlives_its_mapping():
    import gc

    from engine import host_memory

    cache = host_memory.zeros((2, 3, 5, 16, 2, 8), torch.bfloat16)
    assert cache.shape == (2, 3, 5, 16, 2, 8) and cache.dtype == torch.bfloat16 and not cache.any()
    layer = cache[1, 2]  # a view, as each layer holds, is all that is left of it
    del cache
    gc.collect()
    layer.fill_(1)
    assert layer.sum().item() == 5 * 16 * 2 * 8
