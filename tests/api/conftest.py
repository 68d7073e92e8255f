"""One real server per session (the model loads once), shared by every API test."""

from __future__ import annotations

import pytest

from live_server import RunningServer, start_server, stop_server


@pytest.fixture(scope="session")
def api_server(tmp_path_factory) -> RunningServer:
    """The server without an API key; every test shares it (the model loads once)."""
    server = start_server(tmp_path_factory.mktemp("api") / "server.log")
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def client(api_server):
    from openai import OpenAI

    with OpenAI(base_url=api_server.v1, api_key="unused", max_retries=0, timeout=120) as c:
        yield c
