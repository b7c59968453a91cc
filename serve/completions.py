"""POST /v1/chat/completions and /v1/completions: each request is one queue job, answered whole or streamed.

A retried POST with the same Idempotency-Key finds the job of the first one and follows it. A client that
disconnects before the answer is whole cancels its job, unless it sent an Idempotency-Key: such a client
declared that it will come back for the job, so the job runs on for its retry to attach to.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from producer import AsyncClient, DuplicateJobError, JobNotFound
from producer.protocol import StreamEvent
from serve import responses
from serve.disconnect import EventStream, unless_gone
from serve.errors import APIError, bad_request, from_result
from serve.queues import Queues
from serve.translate import Kind, Parsed, parse

IDEMPOTENCY_HEADER = "idempotency-key"
# Not an HTTP status a client reads (it is gone); what access logs and metrics record for a request whose
# client left, as nginx does.
CLIENT_CLOSED = 499


async def handle(kind: Kind, request: Request, queues: Queues) -> Response:
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("the request body is not valid JSON") from None
    key = request.headers.get(IDEMPOTENCY_HEADER)
    p = parse(kind, body, key, queues.config.default_max_tokens)
    client = queues.for_model(p.model)
    await _submit(client, queues, p, key is not None)

    async def cancel() -> None:
        if key is None:
            await client.cancel(p.request.id)

    if p.stream:
        return await _stream(request, client, p, cancel)
    gone, res = await unless_gone(request.receive, client.result(p.request.id))
    if gone:
        await cancel()
        return Response(status_code=CLIENT_CLOSED)
    if res.status != "completed":
        raise from_result(res)
    return JSONResponse(responses.completion(p, res))


async def _submit(client: AsyncClient, queues: Queues, p: Parsed, keyed: bool) -> None:
    if keyed:
        try:
            await client.status(p.request.id)
            return  # a retry: the job exists, whatever the queue's depth now
        except JobNotFound:
            pass
    await queues.check_depth(client)
    try:
        await client.submit(p.request)
    except DuplicateJobError:
        if not keyed:  # a random id that exists: not a retry, so not this request's job
            raise
    except ValueError as e:  # the client's size limits, the same the workers enforce by default
        raise bad_request(str(e), code="limit_exceeded") from None


async def _stream(request: Request, client: AsyncClient, p: Parsed, cancel: Callable[[], Awaitable[None]]
                  ) -> Response:
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
        raise from_result(first.result)
    return EventStream(_chunks(p, first, events), cancel)


async def _chunks(p: Parsed, first: StreamEvent, events: AsyncIterator[StreamEvent]) -> AsyncIterator[bytes]:
    out = responses.Chunks(p)
    yield out.first()
    ev: StreamEvent | None = first
    while ev is not None:
        if ev.type == "token":
            yield out.text(ev.text, ev.logprobs)
        elif ev.type == "done":
            yield out.last(ev.result)
            return
        else:  # failed, expired or cancelled mid-way: the SDKs raise on a chunk that holds an error
            yield responses.sse(from_result(ev.result).body())
            yield responses.DONE
            return
        ev = await anext(events, None)
