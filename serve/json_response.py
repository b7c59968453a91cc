"""Every JSON answer of `pagedq serve`: Starlette's JSONResponse, encoded by serve.responses.dumps (text that UTF-8
cannot hold goes out escaped, never as a 500). Its own module: the batch CLI imports serve.responses without the
HTTP server's packages."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from serve.responses import dumps


class JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content, allow_nan=False)
