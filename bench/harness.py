"""Shared machinery of the GPU kernel benchmarks: timing, copy bandwidth, the result table.

A benchmark module (bench/kernels_turbo.py, bench/kernels_experts.py) exposes
``run(device, copy_gbs) -> (title, rows)``; bench/kernels.py measures the copy bandwidth once,
calls it, and hands the rows to ``report``. Only torch and the standard library are imported
here so the harness runs on a GPU box that has no serving dependencies installed.
"""

from __future__ import annotations

import datetime
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_DOC = REPO_ROOT / "docs" / "BENCHMARKS.md"
KERNELS_SECTION = "## Kernels"


def require_gpu() -> torch.device:
    """The CUDA device to benchmark on; without one, say so and exit non-zero."""
    if not torch.cuda.is_available():
        print(
            "bench: needs a GPU (torch.cuda.is_available() is False). Kernel timings on CPU "
            "would only measure the reference path; run this on the GPU machine.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()
    return device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    fn: Callable[[int], object],
    n_inputs: int = 1,
    warmup: int = 10,
    iters: int = 100,
    device: torch.device | None = None,
) -> float:
    """Median milliseconds of one call of ``fn(i)``, ``i`` cycling over ``range(n_inputs)``.

    The caller prepares ``n_inputs`` independent input sets (see ``rotation_count``) so that
    consecutive calls do not find their operands in L2 from the previous call; warm-up calls
    (compilation, autotuning, allocator growth) are excluded. On CUDA each call is bracketed by
    device events and the timed calls are queued behind a busy-wait kernel, so the events time
    the kernels rather than the host's launch overhead; elsewhere the wall clock is used, which
    is only good for exercising this function in tests.
    """
    if n_inputs < 1 or iters < 1 or warmup < 0:
        raise ValueError(f"time_ms: need n_inputs >= 1, iters >= 1, warmup >= 0; got {n_inputs}, {iters}, {warmup}")
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    host_s_per_call = 0.0
    for i in range(warmup):
        if i == 1:  # the first call compiles; time the host side of the others
            t0 = time.perf_counter()
        fn(i % n_inputs)
    if warmup >= 2:
        host_s_per_call = (time.perf_counter() - t0) / (warmup - 1)
    _synchronize(device)
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        _keep_device_busy(1.5 * iters * host_s_per_call)
        for i in range(iters):
            starts[i].record()
            fn(i % n_inputs)
            ends[i].record()
        torch.cuda.synchronize(device)
        samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        samples = []
        for i in range(iters):
            t0 = time.perf_counter()
            fn(i % n_inputs)
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def host_seconds_per_call(fn: Callable[[], object], calls: int, warmup: int = 5) -> float:
    """Host time of one ``fn()`` call, averaged over ``calls`` after ``warmup`` (no device sync: what the calling
    thread spends, e.g. a CPU op or building a step's inputs)."""
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


# Cycles per second used to turn a wait into torch.cuda._sleep cycles; H200 boosts to 1.98 GHz,
# and a slower clock only makes the wait longer, which is harmless.
_GPU_CYCLES_PER_S = 2.0e9


def _keep_device_busy(seconds: float) -> None:
    """Occupy the stream for ``seconds`` so the host can enqueue the timed calls back to back."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None and seconds > 0:
        sleep(int(min(seconds, 1.0) * _GPU_CYCLES_PER_S))


def rotation_count(bytes_per_input: int, device: torch.device, limit: int = 64) -> int:
    """How many input sets to rotate through so together they span twice the L2 cache."""
    if bytes_per_input <= 0:
        raise ValueError(f"rotation_count: bytes_per_input must be positive, got {bytes_per_input}")
    l2_bytes = 64 << 20  # generous default when the device does not report it (H200: 60 MiB)
    if device.type == "cuda":
        l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size or l2_bytes
    return max(1, min(limit, math.ceil(2 * l2_bytes / bytes_per_input)))


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Measured device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written.

    The buffer (1 GiB by default) is far larger than L2, so this is the memory ceiling every
    memory-bound kernel is compared against.
    """
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda _: dst.copy_(src), warmup=3, iters=iters, device=device)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


@dataclass
class Row:
    """One benchmark case: our kernel and the baseline timed in the same run, same inputs."""

    case: str
    ours_ms: float
    baseline_ms: float | None = None  # None when there is no baseline for this case
    bytes_moved: int | None = None  # minimum bytes our kernel must read + write (None: not memory-bound)
    baseline_name: str = ""
    note: str = ""

    @property
    def speedup(self) -> float | None:
        """Baseline time over ours: above 1 means ours is faster."""
        return None if self.baseline_ms is None else self.baseline_ms / self.ours_ms

    @property
    def achieved_gbs(self) -> float | None:
        return None if self.bytes_moved is None else self.bytes_moved / (self.ours_ms * 1e-3) / 1e9

    def fraction_of_copy(self, copy_gbs: float) -> float | None:
        achieved = self.achieved_gbs
        return None if achieved is None else achieved / copy_gbs


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[Row], copy_gbs: float) -> str:
    """A markdown table: it reads fine in a terminal and pastes unchanged into docs."""
    lines = [
        "| case | ours (ms) | baseline | baseline (ms) | speedup | GB/s | of copy BW | note |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        frac = r.fraction_of_copy(copy_gbs)
        lines.append(
            f"| {r.case} | {r.ours_ms:.4f} | {r.baseline_name or '-'} | {_fmt(r.baseline_ms, '.4f')} "
            f"| {_fmt(r.speedup, '.2f')}x | {_fmt(r.achieved_gbs, '.0f')} "
            f"| {'-' if frac is None else f'{frac:.0%}'} | {r.note} |"
        )
    return "\n".join(lines)


def _git_commit(root: Path = REPO_ROOT) -> str:
    """HEAD of the checkout, "+ uncommitted changes" when the tracked files differ from it (a tree copied to the
    GPU machine may carry an older .git than its files), or TURBOSERVE_COMMIT where the caller knows better."""
    if os.environ.get("TURBOSERVE_COMMIT"):
        return os.environ["TURBOSERVE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root, capture_output=True,
                               timeout=30).returncode == 1
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} + uncommitted changes" if head and dirty else head or "unknown"


def environment_line(device: torch.device) -> str:
    """Hardware and software the numbers were measured on."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return f"{name}, torch {torch.__version__}, Triton {triton_version}, commit {_git_commit()}"


def dated_heading(title: str) -> str:
    """The heading of a BENCHMARKS.md block: the title and the UTC minute it was measured."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"### {title} ({now})"


def command_line(script: str, argv: list[str] | None) -> str:
    """The exact command a block was measured with (argv None: this process's own arguments)."""
    return f"python {script} " + shlex.join(sys.argv[1:] if argv is None else argv)


def report(
    title: str,
    rows: list[Row],
    copy_gbs: float,
    command: str,
    device: torch.device | None = None,
    doc_path: Path | None = BENCHMARKS_DOC,
) -> str:
    """Print the table and insert a dated block into ``doc_path`` (None: print only); returns the block."""
    if not rows:
        raise ValueError(f"report({title!r}): no rows; a benchmark that measured nothing has nothing to record")
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    block = (
        f"{dated_heading(title)}\n\n"
        f"- Command: `{command}`\n"
        f"- Hardware: {environment_line(device)}\n"
        f"- Measured device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)\n"
        f"- Times are medians of device-event timings, warm-up excluded, inputs rotated past L2.\n\n"
        f"{format_table(rows, copy_gbs)}\n"
    )
    print(block)
    if doc_path is not None:
        record(block, doc_path, KERNELS_SECTION)
    return block


def record(block: str, doc: Path, section: str) -> None:
    """Put the dated block first among ``section``'s blocks, after its intro text (section created when
    missing): every section of BENCHMARKS.md reads newest first."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if section + "\n" in text:
        head, tail = text.split(section + "\n", 1)
        section_end = tail.find("\n## ") + 1 or len(tail)  # the next top-level heading, or the end
        first_block = tail.find("\n### ", 0, section_end)
        at = section_end if first_block < 0 else first_block + 1
        text = head + section + "\n" + tail[:at].rstrip("\n") + "\n\n" + block + "\n" + tail[at:].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n\n" + block
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def self_check() -> None:
    """`python bench/harness.py` on the GPU: our timer beside Triton's do_bench on known work."""
    device = require_gpu()
    from triton.testing import do_bench

    print(f"{environment_line(device)}\ncopy bandwidth: {copy_bandwidth_gbs(device):.0f} GB/s (read + write)")
    src, dst = (torch.empty(64 << 20, device=device).uniform_() for _ in range(2))  # 256 MiB each
    x, y, z = (torch.randn(4096, device=device) for _ in range(3))
    cases = {"copy 256 MiB": lambda: dst.copy_(src), "add 4096 floats": lambda: torch.add(x, y, out=z)}
    for name, work in cases.items():
        ours = time_ms(lambda _: work(), warmup=10, iters=200, device=device)
        theirs = do_bench(work, return_mode="median")
        print(f"{name}: time_ms {ours:.4f} ms, triton do_bench {theirs:.4f} ms")


if __name__ == "__main__":
    self_check()
