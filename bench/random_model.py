"""Small random-weight models with SmolLM2's real tokenizer: tests run on them, and the overhead benchmark
measures the host's work around their nearly free forward."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from engine.config import DEFAULT_MODEL
from engine.weights.loader import resolve_model

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def make_tiny_model(path: str, arch: str = "llama", seed: int = 0, tie: bool | None = None, layers: int = 2,
                    kv_heads: int = 2, shape: dict | None = None) -> str:
    """Write a small random-weight model of `arch` with SmolLM2's tokenizer to `path` (hidden size 64): for
    fast tests, and for benchmarks of what the host does around a forward that costs next to nothing. shape: config
    fields that override the tiny ones (a larger random model, for benchmarks of the forward itself)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {TINY_ARCHS}")
    target = Path(path)
    if (target / "config.json").exists():
        return str(target)
    tok_dir = resolve_model(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    extra: dict = {"llama": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
                   "mistral": {"sliding_window": None},
                   "qwen2": {},
                   "qwen3": {"head_dim": 32}}[arch]
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=(arch in ("llama", "qwen3")) if tie is None else tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.1,
        **extra,
    )
    config = AutoConfig.for_model(arch, **{**fields, **(shape or {})})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
