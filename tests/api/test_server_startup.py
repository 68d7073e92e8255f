"""`turboserve serve` builds the engine in a thread of its own (runtime.engine.build_engine): with the main thread
running no parallel torch op, the engine loop's CPU ops keep OpenMP's cheap path (its docstring says why)."""

import threading

import torch

from server.api import server as server_module
from server.config import EngineConfig, ServerConfig
from server.runtime import engine as engine_module
from server.runtime import warmup as warmup_module


class FakeEngine:
    model_name = "fake"
    built_in: list[threading.Thread] = []
    fail: Exception | None = None
    device = torch.device("cpu")
    alive = True

    def is_alive(self):
        return FakeEngine.alive

    def __init__(self, config):
        FakeEngine.built_in.append(threading.current_thread())
        if FakeEngine.fail is not None:
            raise FakeEngine.fail

    def start(self):
        pass

    def shutdown(self):
        pass


def serve_with(monkeypatch, fail=None, events=None):
    FakeEngine.built_in, FakeEngine.fail = [], fail
    events = [] if events is None else events
    monkeypatch.setattr(engine_module, "Engine", FakeEngine)
    monkeypatch.setattr(server_module, "create_app", lambda engine, config: engine)
    monkeypatch.setattr(server_module.uvicorn, "run", lambda app, **kwargs: events.append("serve"))
    monkeypatch.setattr(warmup_module, "warm_up", lambda engine: events.append("warm-up") or 1.0)
    return server_module.run_server(EngineConfig(), ServerConfig())


def test_a_gpu_server_warms_up_before_it_listens_and_a_cpu_server_does_not(monkeypatch):
    events = []
    assert serve_with(monkeypatch, events=events) == 0
    assert events == ["serve"]
    monkeypatch.setattr(FakeEngine, "device", torch.device("cuda"))
    events.clear()
    assert serve_with(monkeypatch, events=events) == 0
    assert events == ["warm-up", "serve"]


def test_an_engine_that_dies_in_the_warm_up_ends_the_server_with_exit_code_1(monkeypatch):
    monkeypatch.setattr(FakeEngine, "device", torch.device("cuda"))
    monkeypatch.setattr(FakeEngine, "alive", False)
    events = []
    assert serve_with(monkeypatch, events=events) == 1
    assert events == ["warm-up"], "it never listens"


def test_the_engine_is_built_off_the_main_thread(monkeypatch):
    assert serve_with(monkeypatch) == 0
    assert len(FakeEngine.built_in) == 1 and FakeEngine.built_in[0] is not threading.main_thread()


def test_a_bad_flag_found_while_building_still_ends_with_exit_code_2(monkeypatch):
    assert serve_with(monkeypatch, fail=ValueError("--kv-cache-dtype turbo3 needs head_dim % 64 == 0")) == 2
