"""The cap on a request's body, counted as it streams in: a Content-Length past it, or more bytes than it (a chunked
upload has no Content-Length, and a client may lie in one) are a 413 in OpenAI's shape, before the body is held.

An ASGI middleware that wraps `receive`: the cap holds when the handler reads the body, after the route's own
checks (its key: a request without one is a 401 whatever its size). `/v1/files` takes max_file_bytes and the
multipart framing around it; every other route max_body_bytes.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.config import ServeConfig
from serve.errors import APIError

FILES = "/v1/files"
FORM_SLACK = 64 * 1024  # a multipart body's framing beside its file


def cap_of(scope: Scope, config: ServeConfig) -> int:
    if scope["method"] == "POST" and scope["path"] == FILES:
        return config.max_file_bytes + FORM_SLACK
    return config.max_body_bytes


def declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def too_large(cap: int) -> APIError:
    return APIError(413, f"the request body is larger than {cap} bytes, this server's limit", code="request_too_large")


class BodyLimit:
    def __init__(self, app: ASGIApp, config: ServeConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = cap_of(scope, self.config)
        declared = declared_length(scope)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            if declared is not None and declared > cap:
                raise too_large(cap)
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap:
                    raise too_large(cap)
            return message

        await self.app(scope, counted, send)
