"""POST /v1/chat/completions and /v1/completions: each request is one queue job, answered whole or streamed.

Cheap checks come first, so that a request refused costs little whatever it holds: the key (serve.auth) and the
body's size (serve.body_limit) before the handler runs, then the body parsed and held to the client's limits and
its key's lane and priority allowance (serve.lanes), then the process's and the key's admission (open requests,
the depth of the job's lane, the key's rates and cap on jobs), and only then its constraint compiled, off the
event loop (serve.checks), and its job submitted. A large body is parsed in another process (serve.cpu_process):
its decoding would hold the GIL, and so every stream, for tens of ms.

A request waits on its job through the process's event reader (serve.events), holding no Redis connection; a
process answers at most max_open_requests of them at once (429 with Retry-After past it). A streamed request whose
client does not read is dropped once its job's events pile up past their bound: as if the client had left.

A retried POST with the same Idempotency-Key finds the job of the first one and follows it (with API keys, the
same key's: each key's Idempotency-Keys are its own). A client that disconnects before the answer is whole
cancels its job, unless it sent an Idempotency-Key: such a client declared that it will come back for the job,
so the job runs on for its retry to attach to. With API keys, the request that submitted a job settles its
usage once it reads the job's end (serve.tenancy; the sweep settles the jobs whose requests went away).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

import redis as redis_lib
from starlette.requests import Request
from starlette.responses import Response

from producer import AsyncClient, DuplicateJobError, JobNotFound
from producer.protocol import JobResult, Limits, StreamEvent
from serve import cpu_process, lanes, responses, tenancy
from serve.api_keys import ApiKey
from serve.auth import key_of
from serve.checks import Checks
from serve.disconnect import EventStream, unless_gone
from serve.errors import APIError, bad_request, from_result
from serve.events import Subscription
from serve.json_response import JSON
from serve.queues import Queues, redis_refusal
from serve.tenancy import Ticket
from serve.tenants import Tenants
from serve.translate import Kind, Parsed, parse

IDEMPOTENCY_HEADER = "idempotency-key"
LIMITS = Limits()
# Not an HTTP status a client reads (it is gone); what access logs and metrics record for a request whose
# client left, as nginx does.
CLIENT_CLOSED = 499


async def handle(kind: Kind, request: Request, queues: Queues, tenants: Tenants, checks: Checks) -> Response:
    raw = await request.body()
    key = key_of(request)
    idem = request.headers.get(IDEMPOTENCY_HEADER)
    p = await cpu_process.acall(len(raw), read, kind, raw, tenancy.job_id(key, idem),
                                queues.config.default_max_tokens)
    p.request = lanes.interactive(p.request, p.service_tier, key)  # its lane and group; a 400 past the key's
    client = queues.for_model(p.model)
    queues.admit()
    sub: Subscription | None = None
    handed_off = False
    try:
        ticket, fresh = await _submit(client, queues, tenants, checks, key, p, idem is not None)
        sub = await queues.events.subscribe(client.keys, p.request.id, fresh, bounded=p.stream)

        async def cancel() -> None:
            if idem is None:
                await client.cancel(p.request.id)

        async def settle(res: JobResult) -> None:
            await tenants.settle(ticket, res)

        if p.stream:
            response = await _stream(request, queues, sub, p, cancel, settle)
            # An EventStream is the subscription's owner now: it closes it and releases the request at its end.
            handed_off = isinstance(response, EventStream)
            return response
        gone, res = await unless_gone(request.receive, sub.result())
        if gone:
            await cancel()
            return Response(status_code=CLIENT_CLOSED)
        await settle(res)
        if res.status != "completed":
            raise from_result(res)
        return JSON(responses.completion(p, res))
    finally:
        if not handed_off:
            _end(queues, sub)


def read(kind: Kind, raw: bytes, job_id: str | None, default_max_tokens: int | None) -> Parsed:
    """The request's job, parsed and held to the size limits the queue clients and the workers enforce by default
    (Limits()); a 400 naming what is wrong. Runs in serve.cpu_process's process for a large body."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad_request("the request body is not valid JSON") from None
    p = parse(kind, body, job_id, default_max_tokens, check=False)
    try:
        LIMITS.check(p.request)
    except ValueError as e:
        raise bad_request(str(e), code="limit_exceeded") from None
    return p


def _end(queues: Queues, sub: Subscription | None) -> None:
    if sub is not None:
        sub.close()
    queues.release()


async def _submit(client: AsyncClient, queues: Queues, tenants: Tenants, checks: Checks, key: ApiKey | None,
                  p: Parsed, keyed: bool) -> tuple[Ticket | None, bool]:
    """Submit the request's job, or find the job of the request it retries (keyed: it has an Idempotency-Key).
    With API keys: the key's rate limits admit it first, then its cap on jobs holds it. Returns what settling
    the job will need (None: nothing to settle here, it retried another request's job), and whether this request
    queued the job just now."""
    if keyed:
        try:
            await client.status(p.request.id)
            await tenants.admit(key)
            return None, False  # a retry: the job exists, whatever the queue's depth now (and its constraint ok)
        except JobNotFound:
            pass
    await queues.check_depth(client, p.request.lane)
    charged = tenancy.estimate(p.request) if key is not None else 0
    await tenants.admit(key, charged)
    if p.request.constraint is not None:  # costly: only for a request that would be queued otherwise
        try:
            await tenants.room(client.keys, key)
            await checks.check(p.request.constraint, p.constraint_param)
        except APIError:
            await tenants.refund(key, charged)
            raise
    try:
        if key is None:
            await queues.submit(client, p.request)
            ticket = None
        else:
            ticket = await tenants.submit(client.keys, p.request, key, charged)
        queues.submitted(client, p.request.lane)
        return ticket, True
    except DuplicateJobError:
        if not keyed:  # a random id that exists: not a retry, so not this request's job
            raise
        return None, False


async def _stream(request: Request, queues: Queues, sub: Subscription, p: Parsed,
                  cancel: Callable[[], Awaitable[None]], settle: Callable[[JobResult], Awaitable[None]]) -> Response:
    # The first event comes before the response starts: a job that fails at once (an unknown model, a prompt
    # too long) answers with its HTTP error instead of a stream that holds only an error.
    gone, first = await unless_gone(request.receive, sub.next())
    if gone:
        await cancel()
        return Response(status_code=CLIENT_CLOSED)
    if first.terminal and first.type != "done":
        await settle(first.result)
        raise from_result(first.result)
    return EventStream(_chunks(queues, p, first, sub, settle), cancel, on_close=lambda: _end(queues, sub),
                       cut=sub.dropped)


async def _chunks(queues: Queues, p: Parsed, first: StreamEvent, sub: Subscription,
                  settle: Callable[[JobResult], Awaitable[None]]) -> AsyncIterator[bytes]:
    out = responses.Chunks(p)
    yield out.first()
    ev = first
    while True:
        # Every event that came already goes out in one write: the terminal one, if any, is the last.
        events = [ev, *sub.ready()]
        text = b"".join(out.text(e.text, e.logprobs, e.index) for e in events if e.type == "token")
        if text:
            yield text
        end = events[-1]
        if end.terminal:
            await settle(end.result)  # before the last bytes: a client that leaves on [DONE] stops this generator
            if end.type == "done":
                yield out.last(end.result)
            else:  # failed, expired or cancelled mid-way: the SDKs raise on a chunk that holds an error
                yield responses.sse(from_result(end.result).body())
                yield responses.DONE
            return
        try:
            ev = await sub.next()
        except redis_lib.RedisError as e:  # Redis went away mid-stream: say so, as the SDKs read errors
            yield responses.sse(redis_refusal(e, queues.config, queues.metrics).body())
            yield responses.DONE
            return
