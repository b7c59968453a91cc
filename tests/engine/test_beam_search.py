"""Beam search equals transformers' generate(num_beams=B, do_sample=False), token for token (issue 24): every
beam returned, in order, for B in 2 and 4 on each tiny architecture, with and without EOS, and under a KV pool
small enough to force preemption; the block accounting holds after every step."""

import pytest
import torch
from shared_blocks import OTHER, PROMPT, run_checking_blocks

from engine import EngineConfig, LLMEngine, SamplingParams

_HF: dict[str, object] = {}


def hf_beams(path: str, prompt: list[int], width: int, max_tokens: int, eos: list[int] | None,
             **kw) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    if path not in _HF:
        _HF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([prompt])
    out = _HF[path].generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                             do_sample=False, max_new_tokens=max_tokens, eos_token_id=eos,
                             pad_token_id=(eos or [0])[0], **kw)
    # transformers pads a beam that ended early: ours ends at its stop token.
    return [_unpad(r[len(prompt):].tolist(), eos) for r in out]


def _unpad(ids: list[int], eos: list[int] | None) -> list[int]:
    for i, t in enumerate(ids):
        if eos and t in eos:
            return ids[: i + 1]
    return ids


def beams(width: int, max_tokens: int, with_eos: bool, **kw) -> SamplingParams:
    return SamplingParams(n=width, use_beam_search=True, temperature=0, max_tokens=max_tokens,
                          ignore_eos=not with_eos, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_transformers(tiny_model, arch, width):
    path = tiny_model(arch)
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=96, attention_backend="torch"))
    eos = sorted(engine.eos_token_ids)
    cases = [(PROMPT, 10, False), (OTHER, 24, True)]
    outs = engine.generate([p for p, _, _ in cases], [beams(width, m, e) for _, m, e in cases])
    for (prompt, max_tokens, with_eos), out in zip(cases, outs):
        want = hf_beams(path, prompt, width, max_tokens, eos if with_eos else None)
        assert [c.token_ids for c in out.choices] == want, f"{arch}, {width} beams, eos={with_eos}"
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.mark.slow
def test_length_penalty_and_early_stopping_mean_what_transformers_means(tiny_model):
    path = tiny_model("llama")
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=96, attention_backend="torch"))
    eos = sorted(engine.eos_token_ids)
    for settings in (dict(length_penalty=0.5, early_stopping=True), dict(length_penalty=2.0, early_stopping="never")):
        [out] = engine.generate([OTHER], beams(3, 20, True, **settings))
        want = hf_beams(path, OTHER, 3, 20, eos, **settings)
        assert [c.token_ids for c in out.choices] == want, settings


def test_fewer_returned_than_beams_are_the_best(tiny_model):
    path = tiny_model("qwen2")
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=96, attention_backend="torch"))
    [out] = engine.generate([PROMPT], SamplingParams(n=2, beam_width=4, use_beam_search=True, temperature=0,
                                                      max_tokens=10, ignore_eos=True))
    want = hf_beams(path, PROMPT, 4, 10, None)[:2]
    assert [c.token_ids for c in out.choices] == want
    assert out.choices[0].score >= out.choices[1].score


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_beams_on_every_backend(tiny_model, backend):
    """The block copies run as each backend's op (C++ memcpy, a Triton kernel)."""
    path = tiny_model("llama")
    cfg = dict(model=path, num_kv_blocks=96, block_size=16, dtype="float32")
    ref = LLMEngine(EngineConfig(**cfg, attention_backend="torch"))
    engine = LLMEngine(EngineConfig(**cfg, attention_backend=backend))
    params = beams(4, 8, False)
    assert [c.token_ids for c in engine.generate([PROMPT], params)[0].choices] == \
        [c.token_ids for c in ref.generate([PROMPT], params)[0].choices]


@pytest.mark.slow
def test_beams_under_preemption(tiny_model):
    """Three beam groups and a sampling group in a pool that cannot hold them all: beam gangs are preempted whole
    (sampling continuations each on its own), recomputed, and still give transformers' beams."""
    path = tiny_model("llama")
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=22, block_size=8, max_num_batched_tokens=64,
                                    attention_backend="torch"))
    eos = sorted(engine.eos_token_ids)
    preempted = []
    orig = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), orig(seq))
    prompts = [PROMPT, OTHER, PROMPT[5:30]]
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", prompt_token_ids=p, params=beams(4, 16, i == 1))
    engine.add_request("s", prompt_token_ids=OTHER,
                       params=SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=16, ignore_eos=True))
    final = run_checking_blocks(engine)
    assert preempted, "the pool should have been too small to run every group at once"
    for i, p in enumerate(prompts):
        want = hf_beams(path, p, 4, 16, eos if i == 1 else None)
        assert [c.token_ids for c in final[f"b{i}"].choices] == want, f"b{i}"
