"""`pagedq kernels build`: compile the C++ CPU kernels for this CPU and environment ahead of the first start (make
setup and the Docker image run it), so that no worker pays for it, or waits on another that does."""

from __future__ import annotations

import logging
import sys
import time

import click

from cli.errors import Group


@click.group(cls=Group)
def kernels() -> None:
    """The C++ kernels of the CPU path."""


@kernels.command()
@click.option("--cache-dir", envvar="PAGEDQ_CACHE", default=None,
              help="Cache folder; the kernels go to its kernels/ (or to $PAGEDQ_KERNELS_DIR); default: ~/.cache/pagedq")
def build(cache_dir) -> None:
    """Build (once) the CPU kernels for this CPU, interpreter, torch and compiler; print their folder. A host whose
    CPU differs builds its own at the first start."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from engine.weights.loader import cache_root
    from pagedq_kernels import build as kernel_build
    from pagedq_kernels import cpu_ops

    root = kernel_build.default_root(cache_root(cache_dir))
    start = time.monotonic()
    try:
        library, built = kernel_build.ensure_built(root)
    except kernel_build.BuildError as e:
        raise click.ClickException(str(e)) from None
    why = cpu_ops.load(root)
    if why is not None:
        raise click.ClickException(why)
    paths = cpu_ops.linear_paths()
    click.echo(f"{library.parent} ({'built' if built else 'already built'} in {time.monotonic() - start:.0f} s; "
               f"linears: {', '.join(f'{d} on {p}' for d, p in paths.items()) or 'oneDNN'})")
