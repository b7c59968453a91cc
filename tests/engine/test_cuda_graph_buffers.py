"""Decode steps through the padded static buffers that CUDA graphs replay: checked on CPU, eagerly."""

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.runner.decode_buffers import DecodeBuffers, padded_size, padded_sizes
from engine.runner.staging import Staging
from engine.runner.step_inputs import StepInputs

PROMPTS = ["Hello there, how are you?", "The capital of France is", "a", "Q: What is 2 + 2?\nA:",
           "Once upon a time, in a land far away, there lived a"]


def test_padded_sizes():
    assert padded_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert padded_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert padded_sizes(8) == [1, 2, 4, 8]
    assert padded_sizes(1) == [1]
    sizes = padded_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 17, 64)] == [1, 4, 8, 16, 24, 64]
    with pytest.raises(ValueError):
        padded_size(65, sizes)


def decode_inputs(ids, positions, slots, seq_lens, tables) -> StepInputs:
    width = max(map(len, tables))
    table = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    n = len(ids)
    return StepInputs(np.array(ids, dtype=np.int64), np.array(positions, dtype=np.int64),
                      np.array(slots, dtype=np.int64), np.arange(n + 1, dtype=np.int32),
                      np.array(seq_lens, dtype=np.int32), table, np.arange(n), np.arange(n))


def test_padding_rows_write_no_slot_and_read_nothing():
    buf = DecodeBuffers(max_num_seqs=16, max_blocks_per_seq=4, device=torch.device("cpu"))
    staging = Staging(torch.device("cpu"), copies=True)  # the CUDA path's copies, run on the CPU
    size = buf.load(decode_inputs([5, 6, 7], [3, 9, 0], [3, 41, 16], [4, 10, 1], [[0], [2, 1], [1]]), staging)
    assert size == 4
    ids, positions, ctx = buf.inputs(size, backend=None)
    assert ids.tolist() == [5, 6, 7, 0] and positions.tolist() == [3, 9, 0, 0]
    assert ctx.slot_mapping.tolist() == [3, 41, 16, -1]
    assert ctx.seq_lens.tolist() == [4, 10, 1, 0]
    assert ctx.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert ctx.block_table[:3, :2].tolist() == [[0, 0], [2, 1], [1, 0]]
    # A smaller batch later: the rows it no longer uses become padding again.
    assert buf.load(decode_inputs([9], [4], [4], [5], [[0]]), staging) == 1
    buf.load(decode_inputs([1, 2], [1, 1], [1, 17], [2, 2], [[0], [1]]), staging)
    assert buf.inputs(2, None)[2].slot_mapping.tolist() == [1, 17]


def run(engine, prompts, **kw):
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw}
    outs = engine.generate(prompts, SamplingParams(**params))
    return [o.token_ids for o in outs]


def count_padded_steps(engine) -> list[int]:
    sizes = []
    orig = engine.runner.decode_buffers.load

    def spy(inputs, staging):
        size = orig(inputs, staging)
        sizes.append(size)
        return size

    engine.runner.decode_buffers.load = spy
    return sizes


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_decode_gives_the_same_tokens(tiny_model, backend):
    path = tiny_model("llama")
    cfg = dict(model=path, block_size=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    plain = run(LLMEngine(EngineConfig(**cfg)), PROMPTS)
    engine = LLMEngine(EngineConfig(**cfg, attention_backend=backend))
    engine.runner.use_padded_decode(capture=False)
    sizes = count_padded_steps(engine)
    assert run(engine, PROMPTS) == plain
    # 5 running sequences pad to 8; as they finish (same lengths here) no smaller batch shows up
    assert sizes and set(sizes) == {8}
    # one sequence alone: size 1, no padding
    sizes.clear()
    assert run(engine, PROMPTS[:1]) == plain[:1]
    assert set(sizes) == {1}


def test_seeded_sampling_through_padding(tiny_model):
    path = tiny_model("llama")
    cfg = dict(model=path, block_size=8, max_num_seqs=8, max_model_len=128)
    plain = run(LLMEngine(EngineConfig(**cfg)), PROMPTS[:3], temperature=0.8, seed=3)
    engine = LLMEngine(EngineConfig(**cfg))
    engine.runner.use_padded_decode(capture=False)
    assert run(engine, PROMPTS[:3], temperature=0.8, seed=3) == plain


def test_defaults():
    assert EngineConfig().dtype == "float32"
    assert EngineConfig(device="cuda").dtype == "bfloat16"
    assert EngineConfig(device="cuda", dtype="float16").dtype == "float16"
    assert EngineConfig().enforce_eager is False
