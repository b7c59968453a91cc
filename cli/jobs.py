"""`pagedq submit`, `result`, `status`, `cancel` and `workers`: one job's life from the terminal, and the
queues' and workers' state."""

from __future__ import annotations

import json
import time

import click

from cli import errors
from cli.errors import CliError
from cli.options import default_of, queue_options
from producer.keys import DEFAULT_LANE, LANES
from producer.protocol import JobRequest


@click.command()
@queue_options
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Send PROMPT as a user message (the model's chat template)")
@click.option("--stream", is_flag=True, help="Print tokens as they come")
@click.option("--max-tokens", type=int, default=default_of(JobRequest, "max_tokens"), help="Most tokens to generate")
@click.option("--temperature", type=float, default=default_of(JobRequest, "temperature"),
              help="Sampling temperature; 0 is greedy")
@click.option("--model", default=None, help="Model the job asks for; default: whatever the workers serve")
@click.option("--id", "job_id", default=None, help="Idempotency key; default: a new uuid")
@click.option("--no-wait", is_flag=True, help="Print the job id and return")
@click.option("--timeout", type=float, default=None, help="Seconds to wait for the result")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON")
@click.option("--lane", type=click.Choice(LANES), default=DEFAULT_LANE, help="Priority lane, most urgent first")
@click.option("--priority", type=int, default=default_of(JobRequest, "priority"),
              help="Within the lane and the worker's batch: lower runs first")
@click.option("--group", default=None, help="Fair-share group (see `pagedq groups`)")
def submit(redis_url, queue, prompt, chat, stream, max_tokens, temperature, model, job_id, no_wait, timeout,
           as_json, lane, priority, group) -> None:
    """Enqueue one job and print its result (or stream it)."""
    from producer import Client, DuplicateJobError

    fields = {"max_tokens": max_tokens, "temperature": temperature, "model": model, "lane": lane,
              "priority": priority, "group": group}
    if job_id:
        fields["id"] = job_id
    if chat:
        fields["messages"] = [{"role": "user", "content": prompt}]
    else:
        fields["prompt"] = prompt
    with Client(redis_url, queue=queue) as c:
        try:
            job = c.submit(**fields)
        except (DuplicateJobError, ValueError) as e:
            raise click.ClickException(str(e)) from None
        if no_wait:
            click.echo(json.dumps({"id": job.id}) if as_json else job.id)
            return
        try:
            if stream and not as_json:
                res = None
                for ev in job.stream(timeout=timeout):
                    if ev.type == "token":
                        click.echo(ev.text, nl=False)
                    else:
                        res = ev.result
                click.echo()
            else:
                res = job.result(timeout=timeout)
        except TimeoutError:
            raise CliError(f"job {job.id}: no result within {timeout:g} s; it stays queued or running "
                           f"(`pagedq result {job.id}` waits again, `pagedq cancel {job.id}` stops it)",
                           errors.TIMED_OUT) from None
        _print_result(res, as_json, quiet_text=stream)


def _print_result(res, as_json: bool, quiet_text: bool = False) -> None:
    if as_json:
        click.echo(res.model_dump_json(indent=2))  # the status is in the JSON: exit 0 whatever it is
        return
    if res.status != "completed":
        # A cancelled or expired job keeps the text generated before it stopped: show it, then say why.
        if res.text and not quiet_text:
            click.echo(res.text)
        err = f": {res.error.type}: {res.error.message}" if res.error else ""
        part = f" after {res.usage.completion_tokens} tokens" if res.usage.completion_tokens else ""
        raise CliError(f"job {res.id} {res.status}{part}{err}", errors.JOB_NOT_COMPLETED)
    if not quiet_text:
        click.echo(res.text)


def _not_found(c, e: Exception, job_id: str, queue: str) -> CliError:
    from monitor.job_locator import find_queue_of

    other = find_queue_of(c.redis, job_id, queue)
    hint = f"; it is in queue {other!r}: pass --queue {other}" if other else ""
    return CliError(f"{e} (queue {queue!r}){hint}", errors.NOT_FOUND)


@click.command()
@queue_options
@click.argument("job_id")
@click.option("--timeout", type=float, default=None, help="Seconds to wait; default: until it ends")
@click.option("--json", "as_json", is_flag=True, help="Print the whole JobResult as JSON")
def result(redis_url, queue, job_id, timeout, as_json) -> None:
    """Wait for a job's result and print it (a cancelled job's text so far too)."""
    from producer import Client, JobNotFound

    with Client(redis_url, queue=queue) as c:
        try:
            res = c.result(job_id, timeout=timeout)
        except JobNotFound as e:
            raise _not_found(c, e, job_id, queue) from None
        except TimeoutError as e:
            raise CliError(str(e), errors.TIMED_OUT) from None
        _print_result(res, as_json)


@click.command()
@queue_options
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (with --watch: one object per line)")
@click.option("--all", "all_queues", is_flag=True, help="Every queue a worker has served, not only --queue")
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C")
@click.option("--interval", type=float, default=2.0, help="Seconds between refreshes with --watch")
def status(redis_url, queue, job_id, as_json, all_queues, watch, interval) -> None:
    """Per queue: depth, pending, the oldest job's age, consumers and each live worker; with JOB_ID, that
    job's state."""
    from monitor import fleet, status_view
    from producer import Client, JobNotFound

    with Client(redis_url, queue=queue) as c:
        if job_id:
            try:
                click.echo(c.status(job_id))
            except JobNotFound as e:
                raise _not_found(c, e, job_id, queue) from None
            return
        while True:
            queues = fleet.all_queues(c.redis, [queue]) if all_queues else [queue]
            infos = fleet.status_of(c.redis, queues)
            settings = fleet.redis_settings(c.redis)
            if as_json:
                for i in infos:
                    i["redis"] = settings
                out = infos if all_queues else infos[0]
                click.echo(json.dumps(out) if watch else json.dumps(out, indent=2))
            else:
                if watch:
                    click.clear()
                if settings["warning"]:
                    click.echo(f"WARNING: {settings['warning']}\n")
                click.echo("\n\n".join(status_view.queue_table(i) for i in infos))
            if not watch:
                return
            time.sleep(interval)


@click.command()
@queue_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON")
def workers(redis_url, queue, as_json) -> None:
    """Every live worker, across all queues: model, device, batch, KV cache use, throughput."""
    from monitor import fleet, status_view
    from producer.connection import connect
    from producer.keys import Keys

    r = connect(redis_url, decode_responses=True)
    try:
        found = [w for q in fleet.all_queues(r) for w in fleet.live_workers(r, Keys(q))]
    finally:
        r.close()
    if as_json:
        click.echo(json.dumps(found, indent=2))
    else:
        click.echo(status_view.workers_table(found, with_queue=True) if found else "no live workers")


@click.command()
@queue_options
@click.argument("job_id")
def cancel(redis_url, queue, job_id) -> None:
    """Cancel a job: prints cancelled, cancelling, or its final state."""
    from producer import Client, JobNotFound

    with Client(redis_url, queue=queue) as c:
        try:
            click.echo(c.cancel(job_id))
        except JobNotFound as e:
            raise _not_found(c, e, job_id, queue) from None
