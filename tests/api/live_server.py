"""Start and stop a real turboserve (`python -m server serve`: uvicorn + the embedded SmolLM2)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512  # small, so "prompt + max_tokens beyond the context" is cheap to provoke
START_TIMEOUT_S = 180


@dataclass
class RunningServer:
    base_url: str
    log_path: Path
    process: subprocess.Popen

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_path: Path, *args: str, env: dict[str, str] | None = None) -> RunningServer:
    port = _free_port()
    command = [sys.executable, "-m", "server", "serve", "--port", str(port), "--kv-cache-memory", "64MiB",
               "--max-model-len", str(MAX_MODEL_LEN), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    log_file = open(log_path, "w")
    process = subprocess.Popen(command, cwd=REPO, env=full_env, stdout=log_file, stderr=subprocess.STDOUT)
    server = RunningServer(f"http://127.0.0.1:{port}", log_path, process)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} while starting:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    stop_server(server)
    raise RuntimeError(f"server not healthy after {START_TIMEOUT_S} s:\n{server.log()}")


def stop_server(server: RunningServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()




def metric(server: RunningServer, family: str, **labels: str) -> float:
    """The value of the one sample of `family` (with these labels) in the server's /metrics exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == family and labels.items() <= s.labels.items()]
    assert len(samples) == 1, f"expected one sample of {family} {labels} in /metrics, found {samples}"
    return samples[0].value


def wait_for_free_pages(server: RunningServer, timeout_s: float = 10.0) -> float:
    """Seconds until turboserve_kv_pages_used reads 0 (fails after timeout_s)."""
    started = time.monotonic()
    while (used := metric(server, "turboserve_kv_pages_used")) != 0:
        assert time.monotonic() - started < timeout_s, f"{used} KV pages still used after {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - started
