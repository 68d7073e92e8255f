"""`turboserve serve` builds the engine in a thread of its own (runtime.engine.build_engine): with the main thread
running no parallel torch op, the engine loop's CPU ops keep OpenMP's cheap path (its docstring says why)."""

import threading

from server.api import server as server_module
from server.config import EngineConfig, ServerConfig
from server.runtime import engine as engine_module


class FakeEngine:
    model_name = "fake"
    built_in: list[threading.Thread] = []
    fail: Exception | None = None

    def __init__(self, config):
        FakeEngine.built_in.append(threading.current_thread())
        if FakeEngine.fail is not None:
            raise FakeEngine.fail

    def start(self):
        pass

    def shutdown(self):
        pass


def serve_with(monkeypatch, fail=None):
    FakeEngine.built_in, FakeEngine.fail = [], fail
    monkeypatch.setattr(engine_module, "Engine", FakeEngine)
    monkeypatch.setattr(server_module, "create_app", lambda engine, config: engine)
    monkeypatch.setattr(server_module.uvicorn, "run", lambda app, **kwargs: None)
    return server_module.run_server(EngineConfig(), ServerConfig())


def test_the_engine_is_built_off_the_main_thread(monkeypatch):
    assert serve_with(monkeypatch) == 0
    assert len(FakeEngine.built_in) == 1 and FakeEngine.built_in[0] is not threading.main_thread()


def test_a_bad_flag_found_while_building_still_ends_with_exit_code_2(monkeypatch):
    assert serve_with(monkeypatch, fail=ValueError("--kv-cache-dtype turbo3 needs head_dim % 64 == 0")) == 2
