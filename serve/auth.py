"""Optional bearer tokens: with keys configured, every /v1 request must carry `Authorization: Bearer <key>`."""

from __future__ import annotations

import hmac

from serve.errors import APIError


def check(authorization: str | None, keys: list[str]) -> None:
    if not keys:
        return
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    # Compared with every key, in constant time: how long a refusal takes tells nothing of any key.
    ok = scheme.lower() == "bearer" and bool(token)
    ok = any([hmac.compare_digest(token.encode(), k.encode()) for k in keys]) and ok
    if not ok:
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                       code="invalid_api_key")
