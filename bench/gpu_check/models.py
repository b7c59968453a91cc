"""The model of the graphs, e2e and tensor_parallel sections: a real one, random weights of a real one's shape,
or a tiny one; and --prepare, which writes what an offline GPU machine needs."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from bench.gpu_check.common import (
    OK,
)
from engine.config import DEFAULT_MODEL
from engine.weights.loader import cache_root, resolve_model

SHAPE_FOLDER = f"{DEFAULT_MODEL}-shape"  # what --prepare writes: config and tokenizer, no weights
TINY_FOLDER = "tiny-llama"



def prepare(directory: str, echo=print) -> int:
    """Write into `directory` what a GPU machine without the model package (or a network) needs: the default
    model's config, generation config and tokenizer without its weights (gpu-check makes random weights of that
    shape there), and a tiny random model. A few MB: small enough to carry."""
    from bench.random_model import make_tiny_model

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    source = resolve_model(DEFAULT_MODEL)
    shape = root / SHAPE_FOLDER
    if shape.exists():
        shutil.rmtree(shape)
    shape.mkdir()
    for f in source.iterdir():
        if f.is_file() and f.suffix not in (".safetensors", ".bin", ".gguf", ".pt"):
            shutil.copy2(f, shape / f.name)
    tiny = Path(make_tiny_model(str(root / TINY_FOLDER), "llama", 0))
    for folder, what in ((shape, f"{DEFAULT_MODEL}'s config and tokenizer, no weights"),
                         (tiny, "a tiny random Llama (hidden 64, 2 layers)")):
        size = sum(f.stat().st_size for f in folder.iterdir())
        echo(f"wrote {folder} ({size / 2**20:.1f} MiB): {what}")
    echo(f"on the GPU machine: python3 -m bench.gpu_check --model {shape}")
    return OK


def random_weights(folder: Path, seed: int = 0) -> Path:
    """A model folder with random bfloat16 weights of the shape in folder/config.json and folder's tokenizer,
    made once in the pagedq cache."""
    key = hashlib.sha1((folder / "config.json").read_bytes() + f":{seed}".encode()).hexdigest()[:10]
    out = cache_root() / f"random-{folder.name}-{key}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".random-"))
    try:
        model.save_pretrained(tmp)
        for f in folder.iterdir():  # the tokenizer, the chat template and the generation config (its EOS ids)
            if f.is_file() and f.name != "config.json" and f.suffix != ".safetensors":
                shutil.copy2(f, tmp / f.name)
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    return out


@functools.cache
def model_folder(model: str) -> tuple[Path, str]:
    """(local folder, "real" or "random" weights) for --model."""
    if model == "tiny":
        from bench.random_model import make_tiny_model

        return Path(make_tiny_model(str(cache_root() / "gpu-check-tiny-llama"), "llama", 0)), "random"
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").exists() and not any(path.glob("*.safetensors")):
        return random_weights(path), "random"
    return resolve_model(model), "real"
