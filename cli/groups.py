"""`pagedq groups list|set|reset`: fair-share groups, the weights and caps every worker's intake reads."""

from __future__ import annotations

import json

import click

from cli.errors import Group
from cli.options import queue_options


@click.group(cls=Group)
def groups() -> None:
    """Fair-share groups: inside a lane, groups (API keys of `pagedq serve`, or the `group` a producer sets) share
    the workers by weight, each capped at its max running jobs."""


@groups.command("list")
@queue_options
@click.option("--json", "as_json", is_flag=True, help="Print them as JSON")
def groups_list(redis_url, queue, as_json) -> None:
    """Every group with settings or jobs: weight, cap, jobs queued and running per lane ("" is jobs without one)."""
    from producer import Client
    from producer.groups import group_view

    with Client(redis_url, queue=queue) as c:
        rows = group_view(c.redis, c.keys)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'GROUP':<24} {'WEIGHT':>6} {'MAX RUNNING':>11} {'QUEUED':>7} {'RUNNING':>7}  LANES")
    for row in rows:
        lanes = ", ".join(f"{lane} {x['queued']}+{x['running']}" for lane, x in row["lanes"].items())
        cap = "-" if row["max_running"] is None else row["max_running"]
        click.echo(f"{row['group'] or '(none)':<24} {row['weight']:>6} {cap:>11} {row['queued']:>7} "
                   f"{row['running']:>7}  {lanes}")


@groups.command("set")
@queue_options
@click.argument("group")
@click.option("--weight", type=click.IntRange(1, 1000), default=1, help="Its share relative to the other groups")
@click.option("--max-running", type=click.IntRange(min=0), default=None,
              help="The most of its jobs running at once over all workers (default: no cap)")
def groups_set(redis_url, queue, group, weight, max_running) -> None:
    """Set a group's weight and cap; every worker uses them within seconds."""
    from producer import Client
    from producer.groups import GroupSettings, set_group

    with Client(redis_url, queue=queue) as c:
        try:
            set_group(c.redis, c.keys, group, GroupSettings(weight, max_running))
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="GROUP") from None
    click.echo(f"{group}: weight {weight}, max running {'none' if max_running is None else max_running}")


@groups.command("reset")
@queue_options
@click.argument("group")
def groups_reset(redis_url, queue, group) -> None:
    """Back to the defaults: weight 1, no cap."""
    from producer import Client
    from producer.groups import reset_group

    with Client(redis_url, queue=queue) as c:
        try:
            had = reset_group(c.redis, c.keys, group)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="GROUP") from None
    click.echo(f"{group}: {'back to the defaults' if had else 'had no settings'}")
