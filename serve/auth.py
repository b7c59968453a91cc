"""Optional bearer tokens: with keys configured, every /v1 request must carry `Authorization: Bearer <key>`, and
the key it carries is the tenant the request acts for (serve.api_keys)."""

from __future__ import annotations

from starlette.requests import Request

from serve.api_keys import ApiKey, KeyRing
from serve.errors import APIError

KEY_STATE = "api_key"  # the request state's entry that holds the request's key (set by the app's dependency)


def identify(authorization: str | None, ring: KeyRing) -> ApiKey | None:
    """The key of the request; None when the server has no keys (anyone may ask, and sees everything)."""
    if not ring.enabled:
        return None
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    key = ring.identify(token) if scheme.lower() == "bearer" and token else None
    if key is None:
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                       code="invalid_api_key")
    return key


def key_of(request: Request) -> ApiKey | None:
    """The key the request came with; None on a server without keys."""
    return getattr(request.state, KEY_STATE, None)
