"""POST /v1/chat/completions and /v1/completions: each request is one queue job, answered whole or streamed.

A retried POST with the same Idempotency-Key finds the job of the first one and follows it (with API keys, the
same key's: each key's Idempotency-Keys are its own). A client that disconnects before the answer is whole
cancels its job, unless it sent an Idempotency-Key: such a client declared that it will come back for the job,
so the job runs on for its retry to attach to. With API keys, the request that submitted a job settles its
usage once it reads the job's end (serve.tenancy; the sweep settles the jobs whose requests went away).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from producer import AsyncClient, DuplicateJobError, JobNotFound
from producer.protocol import JobResult, StreamEvent
from serve import responses, tenancy
from serve.api_keys import ApiKey
from serve.auth import key_of
from serve.disconnect import EventStream, unless_gone
from serve.errors import APIError, bad_request, from_result
from serve.queues import Queues
from serve.tenancy import Ticket
from serve.tenants import Tenants
from serve.translate import Kind, Parsed, parse

IDEMPOTENCY_HEADER = "idempotency-key"
# Not an HTTP status a client reads (it is gone); what access logs and metrics record for a request whose
# client left, as nginx does.
CLIENT_CLOSED = 499


async def handle(kind: Kind, request: Request, queues: Queues, tenants: Tenants) -> Response:
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("the request body is not valid JSON") from None
    key = key_of(request)
    idem = request.headers.get(IDEMPOTENCY_HEADER)
    p = parse(kind, body, tenancy.job_id(key, idem), queues.config.default_max_tokens)
    client = queues.for_model(p.model)
    ticket = await _submit(client, queues, tenants, key, p, idem is not None)

    async def cancel() -> None:
        if idem is None:
            await client.cancel(p.request.id)

    async def settle(res: JobResult) -> None:
        await tenants.settle(ticket, res)

    if p.stream:
        return await _stream(request, client, p, cancel, settle)
    gone, res = await unless_gone(request.receive, client.result(p.request.id))
    if gone:
        await cancel()
        return Response(status_code=CLIENT_CLOSED)
    await settle(res)
    if res.status != "completed":
        raise from_result(res)
    return JSONResponse(responses.completion(p, res))


async def _submit(client: AsyncClient, queues: Queues, tenants: Tenants, key: ApiKey | None, p: Parsed,
                  keyed: bool) -> Ticket | None:
    """Submit the request's job, or find the job of the request it retries (keyed: it has an Idempotency-Key).
    With API keys: the key's rate limits admit it first, then its cap on jobs holds it; returns what settling
    the job will need (None: nothing to settle here, it retried another request's job)."""
    if keyed:
        try:
            await client.status(p.request.id)
            await tenants.admit(key)
            return None  # a retry: the job exists, whatever the queue's depth now
        except JobNotFound:
            pass
    await queues.check_depth(client)
    try:
        client.limits.check(p.request)  # the client's size limits, the same the workers enforce by default
    except ValueError as e:
        raise bad_request(str(e), code="limit_exceeded") from None
    try:
        if key is None:
            await client.submit(p.request)
            return None
        charged = tenancy.estimate(p.request)
        await tenants.admit(key, charged)
        return await tenants.submit(client.keys, p.request, key, charged)
    except DuplicateJobError:
        if not keyed:  # a random id that exists: not a retry, so not this request's job
            raise
        return None


async def _stream(request: Request, client: AsyncClient, p: Parsed, cancel: Callable[[], Awaitable[None]],
                  settle: Callable[[JobResult], Awaitable[None]]) -> Response:
    events = client.stream(p.request.id).__aiter__()
    # The first event comes before the response starts: a job that fails at once (an unknown model, a prompt
    # too long) answers with its HTTP error instead of a stream that holds only an error.
    gone, first = await unless_gone(request.receive, anext(events, None))
    if gone:
        await cancel()
        return Response(status_code=CLIENT_CLOSED)
    if first is None:
        raise APIError(500, f"job {p.request.id} has no events", "server_error")
    if first.terminal and first.type != "done":
        await settle(first.result)
        raise from_result(first.result)
    return EventStream(_chunks(p, first, events, settle), cancel)


async def _chunks(p: Parsed, first: StreamEvent, events: AsyncIterator[StreamEvent],
                  settle: Callable[[JobResult], Awaitable[None]]) -> AsyncIterator[bytes]:
    out = responses.Chunks(p)
    yield out.first()
    ev: StreamEvent | None = first
    while ev is not None:
        if ev.type == "token":
            yield out.text(ev.text, ev.logprobs, ev.index)
            ev = await anext(events, None)
            continue
        await settle(ev.result)  # before the last bytes: a client that leaves on [DONE] stops this generator
        if ev.type == "done":
            yield out.last(ev.result)
        else:  # failed, expired or cancelled mid-way: the SDKs raise on a chunk that holds an error
            yield responses.sse(from_result(ev.result).body())
            yield responses.DONE
        return
