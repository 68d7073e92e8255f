"""Bearer-key check for /v1/*; /health, /version and /metrics stay open."""

from __future__ import annotations

import hmac

from fastapi import Request

from server.api.errors import ApiError


def require_api_key(api_key: str | None):
    """A FastAPI dependency that accepts only `Authorization: Bearer <api_key>` (no key: all)."""
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of the key matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise ApiError(401, "Missing or incorrect API key: send 'Authorization: Bearer <key>' with the key "
                           "the server was started with (--api-key / TURBOSERVE_API_KEY).",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check
