"""CORS: web pages of the origins given by --allowed-origins may call the API; by default none may (a
stand-in engine: CORS is the app's, not the engine's)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from server.api.app import create_app
from server.config import ServerConfig

ALLOWED = "https://chat.example.com"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


class IdleEngine:
    """Test double: alive, never asked to generate here."""

    model_name = "stub"
    max_model_len = 64
    tokenizer = None

    def is_alive(self) -> bool:
        return True


def client(*origins: str) -> TestClient:
    return TestClient(create_app(IdleEngine(), ServerConfig(api_key="k", allowed_origins=origins)))


def test_an_allowed_origin_passes_the_preflight_and_reads_the_reply():
    c = client(ALLOWED)
    pre = c.options("/v1/chat/completions", headers={"Origin": ALLOWED, **PREFLIGHT})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= set(pre.headers["access-control-allow-headers"].lower().split(", "))
    got = c.get("/health", headers={"Origin": ALLOWED})
    assert got.status_code == 200 and got.headers["access-control-allow-origin"] == ALLOWED
    refused = c.get("/v1/models", headers={"Origin": ALLOWED})  # no key: the key still guards /v1 for pages too
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ALLOWED


@pytest.mark.parametrize("origins", [(), (ALLOWED,)], ids=["default: none", "another origin"])
def test_other_origins_get_no_cors_headers(origins):
    c = client(*origins)
    pre = c.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **PREFLIGHT})
    assert pre.status_code in (400, 405) and "access-control-allow-origin" not in pre.headers
    got = c.get("/health", headers={"Origin": "https://evil.example"})
    assert got.status_code == 200 and "access-control-allow-origin" not in got.headers


def test_any_origin_with_star():
    got = client("*").get("/health", headers={"Origin": "https://anywhere.example"})
    assert got.headers["access-control-allow-origin"] == "*"
