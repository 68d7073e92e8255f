"""Per-kernel timing hook. Every fast launch runs inside ``timed(kernel, device)``.

Sampling is off until ``set_sample_rate`` turns it on; off, the hook costs one branch.
On, every call is counted and the calls of 1 step in 1/rate are timed: on CUDA with a pair
of device events whose elapsed time is read later (``begin_step`` of a following step polls
them without waiting), so timing never synchronizes the device; on CPU, where ops run
synchronously, with the monotonic clock. Rate 1 times every call, with or without steps
(benches). Calls made while a CUDA graph is being captured are not timed: events cannot be
recorded into a capture, and replays do not run Python.

The per-call path is kept short because an eager prefill step passes it a few hundred times:
device names are converted to strings once per device, and timing events are reused from a
pool once they have been read, instead of being created for every launch.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import nullcontext

import torch

from server.metrics import kernels as kernel_metrics

_OFF = nullcontext()
_PENDING_LIMIT = 1024  # unresolved event pairs kept before polling them inline

_sample_rate = 0.0
_enabled = False  # rate > 0: calls are counted
_sampling = False  # this step's calls are timed
_credit = 0.0  # accumulates the rate each step; a step is timed when it reaches 1
_pending: deque = deque()  # (kernel, device, start_event, end_event), oldest first
_free_events: list = []  # events already read, ready to be recorded again
_device_names: dict = {}  # torch.device or str -> its label


def set_sample_rate(rate: float) -> None:
    """Fraction of engine steps whose kernels are timed: 0 disables, 1 times every call."""
    global _sample_rate, _enabled, _sampling, _credit
    if not 0.0 <= rate <= 1.0:
        raise ValueError(
            f"kernel timing sample rate must be between 0 and 1, got {rate}; "
            "use 0 to disable timing, 1 to time every step, e.g. 0.01 for one step in a hundred"
        )
    _sample_rate = rate
    _enabled = rate > 0.0
    _sampling = rate >= 1.0
    _credit = 0.0


def begin_step() -> None:
    """The engine calls this before each step: read finished events, pick whether this step is timed."""
    global _sampling, _credit
    if not _enabled:
        return
    _resolve_ready()
    if _sample_rate < 1.0:
        _credit += _sample_rate
        _sampling = _credit >= 1.0
        if _sampling:
            _credit -= 1.0


def flush() -> None:
    """Wait for every pending device event and record it (tests, benches, shutdown)."""
    for _, _, _, end in _pending:
        end.synchronize()
    _resolve_ready()


def timed(kernel: str, device: torch.device | str):
    """Context manager around one launch of ``kernel`` on ``device``."""
    if not _enabled:
        return _OFF
    device = _device_names.get(device) or _device_name(device)
    kernel_metrics.count_call(kernel, device)
    if not _sampling:
        return _OFF
    return _Timer(kernel, device)


def _device_name(device: torch.device | str) -> str:
    name = _device_names[device] = str(device)
    return name


def _event():
    return _free_events.pop() if _free_events else torch.cuda.Event(enable_timing=True)


class _Timer:
    __slots__ = ("kernel", "device", "start", "t0")

    def __init__(self, kernel: str, device: str):
        self.kernel = kernel
        self.device = device
        self.start = None

    def __enter__(self):
        if self.device.startswith("cuda"):
            if not torch.cuda.is_current_stream_capturing():
                self.start = _event()
                self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.start is not None:
            end = _event()
            end.record()
            _pending.append((self.kernel, self.device, self.start, end))
            if len(_pending) >= _PENDING_LIMIT:
                _resolve_ready()
        elif not self.device.startswith("cuda"):
            kernel_metrics.observe(self.kernel, self.device, time.perf_counter() - self.t0)
        return False


def _resolve_ready() -> None:
    # Events on one stream complete in order, so stop at the first unfinished one.
    while _pending and _pending[0][3].query():
        kernel, device, start, end = _pending.popleft()
        kernel_metrics.observe(kernel, device, start.elapsed_time(end) / 1e3)
        _free_events.extend((start, end))
