"""`pagedq dlq list|retry|purge`: dead letters, jobs given up on after too many attempts."""

from __future__ import annotations

import json

import click

from cli.errors import Group
from cli.options import queue_options


@click.group(cls=Group)
def dlq() -> None:
    """Dead letters: jobs given up on after too many attempts."""


@dlq.command("list")
@queue_options
@click.option("--count", type=int, default=100, help="Most dead letters to show")
@click.option("--json", "as_json", is_flag=True, help="Print them as JSON")
def dlq_list(redis_url, queue, count, as_json) -> None:
    """The newest dead letters: job id, attempts, reason."""
    from producer import Client
    from producer.dlq import list_dead

    with Client(redis_url, queue=queue) as c:
        items = list_dead(c.redis, c.keys, count)
    if as_json:
        click.echo(json.dumps(items, indent=2))
        return
    for d in items:
        click.echo(f"{d['entry']}  {d.get('id')}  attempts={d.get('attempts')}  {d.get('error')}: {d.get('reason')}")


@dlq.command("retry")
@queue_options
@click.argument("job_id")
def dlq_retry(redis_url, queue, job_id) -> None:
    """Send a dead job back to the queue, afresh (attempts from 0)."""
    import redis as redis_lib

    from producer import Client, JobNotFound
    from producer.dlq import retry_dead

    with Client(redis_url, queue=queue) as c:
        try:
            click.echo(retry_dead(c.redis, c.keys, job_id))
        except (JobNotFound, redis_lib.ResponseError) as e:
            raise click.ClickException(str(e)) from None


@dlq.command("purge")
@queue_options
def dlq_purge(redis_url, queue) -> None:
    """Delete every dead letter of the queue."""
    from producer import Client
    from producer.dlq import purge_dead

    with Client(redis_url, queue=queue) as c:
        click.echo(f"purged {purge_dead(c.redis, c.keys)}")
