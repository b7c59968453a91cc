"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status,
so that the official SDKs raise their usual exception classes (BadRequestError, RateLimitError, ...)."""

from __future__ import annotations

from producer.protocol import JobResult


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self) -> tuple:  # as raised in serve.cpu_process's process, then raised again here
        return APIError, (self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, why: str = "") -> APIError:
    return bad_request(f"{param} is not supported by pagedq{': ' + why if why else ''}", param, "unsupported_parameter")


def not_found(what: str, param: str | None = None) -> APIError:
    return APIError(404, what, param=param, code="not_found")


# The worker's error types (see worker/validate.py), as the HTTP status a client would have got had the server
# checked the request itself.
_STATUS = {"invalid_request": 400, "invalid_json": 400, "limit_exceeded": 400, "prompt_too_long": 400,
           "unknown_model": 404}


def from_result(res: JobResult) -> APIError:
    """The error a job that did not complete answers with."""
    if res.status == "cancelled":
        return APIError(409, f"job {res.id} was cancelled", "cancelled", code="cancelled")
    if res.status == "expired":
        return APIError(504, f"job {res.id} expired before it finished", "timeout", code="expired")
    err = res.error
    kind = err.type if err else "worker_error"
    message = err.message if err else f"job {res.id} {res.status}"
    status = _STATUS.get(kind, 500)
    return APIError(status, message, "invalid_request_error" if status < 500 else "server_error", code=kind)
