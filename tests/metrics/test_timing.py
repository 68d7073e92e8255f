"""The kernel timing hook: off costs nothing visible, on it counts every call and times sampled steps."""

import time
import uuid

import pytest
from prometheus_client import REGISTRY

from server.kernels import timing


@pytest.fixture(autouse=True)
def timing_off_afterwards():
    yield
    timing.set_sample_rate(0.0)
    timing._pending.clear()  # fake events left by a failed test must not block the next one
    timing._free_events.clear()  # nor be handed to the next test's timers


def kernel_name() -> str:
    return f"test_kernel_{uuid.uuid4().hex[:8]}"


def calls(kernel: str) -> float:
    return _sample("turboserve_kernel_calls_total", kernel) or 0.0


def timed_count(kernel: str) -> float:
    return _sample("turboserve_kernel_duration_seconds_count", kernel) or 0.0


def _sample(name: str, kernel: str) -> float | None:
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name == name and s.labels.get("kernel") == kernel and s.labels.get("device") == "cpu":
                return s.value
    return None


def test_rate_zero_records_nothing():
    kernel = kernel_name()
    timing.set_sample_rate(0.0)
    for _ in range(3):
        timing.begin_step()
        with timing.timed(kernel, "cpu"):
            pass
    assert calls(kernel) == 0 and timed_count(kernel) == 0


def test_rate_one_times_every_call_with_the_monotonic_clock_on_cpu():
    kernel = kernel_name()
    timing.set_sample_rate(1.0)
    with timing.timed(kernel, "cpu"):
        time.sleep(0.02)
    with timing.timed(kernel, "cpu"):
        pass
    assert calls(kernel) == 2 and timed_count(kernel) == 2
    total = _sample("turboserve_kernel_duration_seconds_sum", kernel)
    assert 0.02 <= total < 1.0, f"two calls, one sleeping 20 ms, summed to {total} s"
    # The 20 ms call lands in the (10 ms, 20 ms] .. (20 ms, 50 ms] buckets, not below 10 ms.
    below_10ms = REGISTRY.get_sample_value(
        "turboserve_kernel_duration_seconds_bucket",
        {"model_name": _model_label(kernel), "kernel": kernel, "device": "cpu", "le": "0.01"},
    )
    assert below_10ms == 1, f"expected only the empty call under 10 ms, got {below_10ms}"


def _model_label(kernel: str) -> str:
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name == "turboserve_kernel_duration_seconds_count" and s.labels.get("kernel") == kernel:
                return s.labels["model_name"]
    raise AssertionError(f"{kernel} was never timed")


def test_quarter_rate_times_one_step_in_four_and_counts_all_calls():
    kernel = kernel_name()
    timing.set_sample_rate(0.25)
    for _ in range(12):
        timing.begin_step()
        for _ in range(2):  # two launches per step
            with timing.timed(kernel, "cpu"):
                pass
    assert calls(kernel) == 24
    assert timed_count(kernel) == 6, "3 of 12 steps sampled, 2 calls each"


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_rate_outside_zero_to_one_is_refused_with_advice(rate):
    with pytest.raises(ValueError, match="between 0 and 1"):
        timing.set_sample_rate(rate)


def test_exception_inside_a_timed_call_propagates_and_is_still_timed():
    kernel = kernel_name()
    timing.set_sample_rate(1.0)
    with pytest.raises(RuntimeError, match="boom"):
        with timing.timed(kernel, "cpu"):
            raise RuntimeError("boom")
    assert timed_count(kernel) == 1


class FakeEvent:
    """Stands in for torch.cuda.Event: the test decides when the device 'finishes' it."""

    clock_ms = 0.0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at, self.done = None, False

    def record(self):
        self.at, self.done = FakeEvent.clock_ms, False  # recording again makes an event pending again

    def query(self) -> bool:
        return self.done

    def synchronize(self):
        self.done = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.done and end.done, "elapsed_time on an unfinished event would block (or fail) on a GPU"
        return end.at - self.at


@pytest.fixture
def fake_cuda(monkeypatch):
    capturing = [False]
    monkeypatch.setattr(timing.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(timing.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    return capturing


def cuda_timed_count(kernel: str) -> float:
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name == "turboserve_kernel_duration_seconds_count" and s.labels.get("kernel") == kernel:
                return s.value
    return 0.0


def test_cuda_events_are_read_on_a_later_step_without_waiting(fake_cuda):
    kernel = kernel_name()
    timing.set_sample_rate(1.0)
    with timing.timed(kernel, "cuda:0"):
        FakeEvent.clock_ms += 3.0  # the launch takes 3 ms of device time
    end = timing._pending[-1][3]
    timing.begin_step()
    assert cuda_timed_count(kernel) == 0, "an unfinished event must stay pending, not be waited for"
    end.done = timing._pending[-1][2].done = True
    timing.begin_step()
    assert cuda_timed_count(kernel) == 1
    total = REGISTRY.get_sample_value(
        "turboserve_kernel_duration_seconds_sum",
        {"model_name": _model_label(kernel), "kernel": kernel, "device": "cuda:0"},
    )
    assert total == pytest.approx(0.003)


def test_flush_waits_for_pending_events(fake_cuda):
    kernel = kernel_name()
    timing.set_sample_rate(1.0)
    for _ in range(3):
        with timing.timed(kernel, "cuda:0"):
            FakeEvent.clock_ms += 1.0
    for _, _, start, _ in timing._pending:
        start.done = True
    timing.flush()
    assert cuda_timed_count(kernel) == 3 and not timing._pending


def test_no_events_are_recorded_into_a_cuda_graph_capture(fake_cuda):
    kernel = kernel_name()
    timing.set_sample_rate(1.0)
    fake_cuda[0] = True
    with timing.timed(kernel, "cuda:0"):
        pass
    assert not timing._pending
    timing.flush()
    assert cuda_timed_count(kernel) == 0


def finish_all_starts():
    for _, _, start, _ in timing._pending:
        start.done = True  # on a GPU a finished end event implies its start finished


def test_timed_steps_reuse_events_once_they_are_read(fake_cuda, monkeypatch):
    created = []

    class CountingEvent(FakeEvent):
        def __init__(self, enable_timing: bool = False):
            super().__init__(enable_timing)
            created.append(self)

    monkeypatch.setattr(timing.torch.cuda, "Event", CountingEvent)
    kernel = kernel_name()
    timing.set_sample_rate(1.0)
    for _ in range(2):
        with timing.timed(kernel, "cuda:0"):
            FakeEvent.clock_ms += 1.0
    finish_all_starts()
    timing.flush()
    assert len(created) == 4 and cuda_timed_count(kernel) == 2
    with timing.timed(kernel, "cuda:0"):
        FakeEvent.clock_ms += 2.0
    assert len(created) == 4, "a read event pair should have been recorded again, not a new one created"
    finish_all_starts()
    timing.flush()
    assert cuda_timed_count(kernel) == 3
