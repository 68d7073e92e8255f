"""Prometheus metrics of turboserve; every family is listed in docs/metrics.md.

Families live in prometheus_client's default registry, so ``/metrics`` serves them with
``prometheus_client.generate_latest()`` (or ``exposition()`` below). The runtime records
through one ``EngineMetrics`` per engine; nothing reads metrics back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from server.metrics import kernels
from server.metrics.kv import KVMetrics
from server.metrics.process import ProcessMetrics
from server.metrics.requests import RequestMetrics, RequestTimeline

__all__ = ["EngineMetrics", "RequestTimeline", "exposition"]


@dataclass
class EngineMetrics:
    """All families bound to one served model name: ``m.requests``, ``m.kv``, ``m.process``."""

    model_name: str
    requests: RequestMetrics = field(init=False)
    kv: KVMetrics = field(init=False)
    process: ProcessMetrics = field(init=False)

    def __post_init__(self):
        self.requests = RequestMetrics(self.model_name)
        self.kv = KVMetrics(self.model_name)
        self.process = ProcessMetrics(self.model_name)
        kernels.set_model_name(self.model_name)

    def on_step(
        self,
        *,
        seconds: float,
        cuda_graph: bool,
        num_running: int,
        num_waiting: int,
        num_tokens: int,
        num_preempted: int,
        pages_used: int,
    ) -> None:
        """After every pass of the engine loop; a pass that scheduled no token records no step time."""
        if num_tokens:
            self.process.on_step(seconds, cuda_graph)
        self.requests.on_step(num_running, num_waiting, num_tokens, num_preempted)
        self.kv.on_pages_used(pages_used)


def exposition() -> tuple[bytes, str]:
    """The text exposition of every family and its content type, for the /metrics route."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
