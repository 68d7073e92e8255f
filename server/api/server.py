"""`turboserve serve`: load the engine, start its loop, serve the app with uvicorn."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from server.api.app import create_app
from server.config import EngineConfig, ServerConfig

log = logging.getLogger(__name__)


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    from server.runtime.engine import Engine

    started = time.perf_counter()
    try:
        # Built in a thread that then exits, so that the main thread runs no parallel torch op: once it has, libgomp
        # keeps its thread pool, and each OpenMP region of another thread (the engine loop's) costs ~70 us more
        # (2 cores: a 576 x 576 GEMV 12 -> 77-85 us), which on CPUs took most of a decode step.
        with ThreadPoolExecutor(max_workers=1) as builder:
            engine = builder.submit(Engine, engine_config).result()
    except (ValueError, FileNotFoundError) as exc:  # bad flags or model path: the user can fix these
        log.error("cannot start: %s", exc)
        return 2
    engine.start()
    log.info("engine ready in %.1f s; serving '%s' on http://%s:%d/v1%s", time.perf_counter() - started,
             engine.model_name, server_config.host, server_config.port,
             " (API key required)" if server_config.api_key else "")
    try:
        uvicorn.run(create_app(engine, server_config), host=server_config.host, port=server_config.port,
                    log_level=server_config.log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0
