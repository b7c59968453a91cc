"""`pagedq dashboard`: the live page of monitor.dashboard, served alone."""

from __future__ import annotations

import click

from cli.errors import check_redis
from cli.options import queue_options


@click.command()
@queue_options
@click.option("--host", envvar="PAGEDQ_DASHBOARD_HOST", default="127.0.0.1",
              help="Address to listen on (the page can submit jobs: keep it private)")
@click.option("--port", envvar="PAGEDQ_DASHBOARD_PORT", type=int, default=8080, help="Port to listen on")
def dashboard(redis_url, queue, host, port) -> None:
    """A live page: queues, workers, throughput and latency charts, dead letters, and a prompt form that streams
    its tokens. It reads only Redis, so it shows every worker of every queue."""
    import uvicorn

    from monitor.dashboard import create_app

    check_redis(redis_url)
    click.echo(f"pagedq dashboard on http://{host}:{port}/")
    uvicorn.run(create_app(redis_url, queue), host=host, port=port, log_level="warning")
