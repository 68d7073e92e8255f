"""Per-kernel timing families, fed by ``server.kernels.timing``.

Durations arrive already measured (device events or a monotonic clock); calls are counted
in a plain dict on the hot path and turned into a counter only when Prometheus scrapes,
so counting costs a dict update, not a lock.
"""

from __future__ import annotations

from collections import Counter as _Tally

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily

# 1 µs .. 1 s in 1-2-5 steps: a tiny elementwise launch to a long prefill GEMM.
DURATION_BUCKETS = [float(f"{m}e{e}") for e in range(-6, 0) for m in (1, 2, 5)] + [1.0]

duration = Histogram(
    "turboserve_kernel_duration_seconds", "Device time of one sampled kernel call.",
    ["model_name", "kernel", "device"], buckets=DURATION_BUCKETS,
)  # fmt: skip

# Kernels run in processes serving one model; the engine names it once at start-up.
_model_name = ""
_calls: _Tally = _Tally()


def set_model_name(name: str) -> None:
    global _model_name
    _model_name = name


def count_call(kernel: str, device: str) -> None:
    _calls[kernel, device] += 1


def observe(kernel: str, device: str, seconds: float) -> None:
    duration.labels(_model_name, kernel, device).observe(seconds)


class _CallCollector:
    def collect(self):
        family = CounterMetricFamily(
            "turboserve_kernel_calls",
            "Kernel calls seen by the timing hook while timing is on (graph replays are not seen).",
            labels=["model_name", "kernel", "device"],
        )
        for (kernel, device), n in _calls.copy().items():  # copy: the engine thread keeps counting
            family.add_metric([_model_name, kernel, device], n)
        yield family


REGISTRY.register(_CallCollector())
