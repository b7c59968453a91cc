"""The `pagedq` command line: one module per command group, each over the packages below it (worker, serve,
monitor, bench, engine, producer); nothing imports this package. Every module loads with click alone: what a
command needs beyond that it imports when it runs, so that `pagedq gpu-check` works where no redis is installed.
"""

from __future__ import annotations

import click

from bench.cli import bench, gpu_check_command
from cli import errors
from cli.dashboard import dashboard
from cli.demo import demo, redis
from cli.dlq import dlq
from cli.groups import groups
from cli.jobs import cancel, result, status, submit, workers
from cli.kernels import kernels
from cli.model_files import models
from cli.serve import batch, serve
from cli.usage import usage
from cli.worker import worker
from worker.version import pagedq_version


@click.group(cls=errors.Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True,
                                                 "auto_envvar_prefix": "PAGEDQ"},
             epilog="Exit codes: " + "; ".join(f"{c} {what}" for c, what in errors.EXIT_CODES.items()))
@click.version_option(pagedq_version(), "--version", prog_name="pagedq")
def main() -> None:
    """pagedq: LLM generation jobs over Redis Streams. Every option can also come from the environment variable
    its help shows."""


COMMANDS = (worker, submit, result, status, workers, cancel, dashboard, dlq, groups, redis, models, kernels, demo, bench,
            gpu_check_command, serve, batch, usage)
for command in COMMANDS:
    main.add_command(command)


def _show_envvars(group: click.Group) -> None:
    # Every option can be set from the environment (explicit names, else click's PAGEDQ_<COMMAND>_<OPTION>):
    # make each --help say which variable, rather than repeating it by hand in every help text.
    for cmd in group.commands.values():
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden and param.name != "help":
                param.show_envvar = True
        if isinstance(cmd, click.Group):
            _show_envvars(cmd)


_show_envvars(main)
