"""Process families: what is running (build info) and how the engine loop spends its steps."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram, Info

LABELS = ["model_name"]

# 100 µs .. 10 s: a graph-replayed decode step of a tiny model to a long CPU prefill.
STEP_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0]  # fmt: skip

build = Info("turboserve_build", "Version and configuration of the serving process (value is always 1).", LABELS)
step_duration = Histogram(
    "turboserve_engine_step_duration_seconds", "Wall time of one engine step (schedule, forward, sample).",
    LABELS, buckets=STEP_BUCKETS,
)  # fmt: skip
steps = Counter("turboserve_engine_steps", "Engine steps run, by whether a CUDA graph replayed the forward.",
                LABELS + ["cuda_graph"])  # fmt: skip
engine_alive = Gauge("turboserve_engine_alive", "1 while the engine step loop runs, 0 once it died.", LABELS)
cuda_graphs_captured = Gauge(
    "turboserve_cuda_graphs_captured", "Decode CUDA graphs captured, one per batch size and context bucket (0: eager).",
    LABELS,
)


def package_version() -> str:
    try:
        return importlib.metadata.version("turboserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+source"  # running from a checkout that was never installed


class ProcessMetrics:
    """The process families with the model_name label bound."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self._duration = step_duration.labels(model_name)
        self._graph_steps = steps.labels(model_name, "true")
        self._eager_steps = steps.labels(model_name, "false")
        cuda_graphs_captured.labels(model_name).set(0)

    def on_start(self, *, device: str, kv_cache_dtype_k: str, kv_cache_dtype_v: str, kv_key_offset: str,
                 kv_key_turned_pairs: int, kv_balance: str, weight_formats: str, kernels: str) -> None:  # fmt: skip
        """Once the engine is built. kv_key_offset: what turbo K pages subtract (partial, fixed, turned; none
        for a dense K cache) and kv_key_turned_pairs how many RoPE pairs of it turn per KV head; kv_balance:
        whether a turbo K / V channel balance is folded into the attention weights (on, off); weight_formats
        e.g. "Q4_1,Q8_0,F32"; kernels as backend.describe says."""
        build.labels(self.model_name).info({
            "version": package_version(), "device": device, "kv_cache_dtype_k": kv_cache_dtype_k,
            "kv_cache_dtype_v": kv_cache_dtype_v, "kv_key_offset": kv_key_offset,
            "kv_key_turned_pairs": str(kv_key_turned_pairs), "kv_balance": kv_balance,
            "weight_formats": weight_formats, "kernels": kernels,
        })  # fmt: skip

    def watch_engine(self, is_alive: Callable[[], bool]) -> None:
        """Report the engine loop's liveness, asked at every scrape (what /health answers)."""
        engine_alive.labels(self.model_name).set_function(lambda: float(is_alive()))

    def on_shutdown(self) -> None:
        """The engine stopped: report 0 without asking it, so the registry no longer keeps it (and its KV pool)."""
        engine_alive.labels(self.model_name).set_function(lambda: 0.0)

    def on_cuda_graphs(self, num_captured: int) -> None:
        cuda_graphs_captured.labels(self.model_name).set(num_captured)

    def on_step(self, seconds: float, cuda_graph: bool) -> None:
        self._duration.observe(seconds)
        (self._graph_steps if cuda_graph else self._eager_steps).inc()
