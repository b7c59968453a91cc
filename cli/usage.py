"""`pagedq usage`: what each API key of `pagedq serve` did, from Redis (every serve process counts there)."""

from __future__ import annotations

import json

import click

from producer import defaults

COLUMNS = (("key", "KEY"), ("key_id", "KEY ID"), ("requests", "REQUESTS"), ("rate_limited", "LIMITED"),
           ("jobs", "JOBS"), ("prompt_tokens", "PROMPT"), ("completion_tokens", "COMPLETION"),
           ("total_tokens", "TOTAL"))


@click.command()
@click.option("--redis-url", envvar=["PAGEDQ_REDIS_URL", "REDIS_URL"], default=defaults.REDIS_URL,
              help="The Redis of the serve processes")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, one object per key")
def usage(redis_url: str, as_json: bool) -> None:
    """Each API key's usage of `pagedq serve`, by name: requests admitted, requests its limits refused, jobs
    that ended, and their prompt and completion tokens (batch jobs included)."""
    from producer.connection import connect
    from producer.flows import drive
    from serve import tenancy

    r = connect(redis_url, decode_responses=True)
    try:
        rows = drive(r, tenancy.report())
    finally:
        r.close()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no API key known here (pagedq serve records its keys when it runs with --api-key or "
                   "--api-key-file)")
        return
    table = [[h for _, h in COLUMNS]] + [[str(row[c]) for c, _ in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    for line in table:
        click.echo("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                             for i, (cell, w) in enumerate(zip(line, widths))).rstrip())
