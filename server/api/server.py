"""`turboserve serve`: load the engine, start its loop, serve the app with uvicorn."""

from __future__ import annotations

import logging
import time

import uvicorn

from server.api.app import create_app
from server.config import EngineConfig, ServerConfig

log = logging.getLogger(__name__)


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    from server.runtime.engine import build_engine

    started = time.perf_counter()
    try:
        engine = build_engine(engine_config)
    except (ValueError, FileNotFoundError) as exc:  # bad flags or model path: the user can fix these
        log.error("cannot start: %s", exc)
        return 2
    engine.start()
    if engine.device.type == "cuda":  # where kernels compile at first use (a CPU runs torch's, compiled already)
        from server.runtime.engine import EngineNotRunning
        from server.runtime.warmup import warm_up

        try:
            log.info("warmed up the prompt and mixed-step kernels in %.1f s", warm_up(engine))
        except EngineNotRunning:
            pass  # said below
        if not engine.is_alive():
            log.error("cannot start: the engine loop died during the warm-up (its traceback is above)")
            engine.shutdown()
            return 1
    log.info("engine ready in %.1f s; serving '%s' on http://%s:%d/v1%s", time.perf_counter() - started,
             engine.model_name, server_config.host, server_config.port,
             " (API key required)" if server_config.api_key else "")
    try:
        uvicorn.run(create_app(engine, server_config), host=server_config.host, port=server_config.port,
                    log_level=server_config.log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0
