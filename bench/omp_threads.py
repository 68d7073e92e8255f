"""What a small CPU op costs from the thread that calls it: `python bench/omp_threads.py` (CPU; prints).

Once the main thread has run an OpenMP region, libgomp keeps its pool, and each region of another thread pays
for waking a team of its own; server.runtime.engine.build_engine keeps the main thread out of torch for that
reason. Times a 576 x 576 GEMV (SmolLM2's o_proj at one token) and a 100K-element add, in microseconds, from: the
main thread; a lone thread while the main thread has run nothing; a thread after the main thread has run ops; the
same with one torch thread.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import host_seconds_per_call  # noqa: E402


def per_call_us(fn) -> float:
    return host_seconds_per_call(fn, calls=2000, warmup=50) * 1e6


def measure(label: str) -> None:
    w, x = torch.randn(576, 576), torch.randn(1, 576)
    a, b = torch.randn(100_000), torch.randn(100_000)
    gemv = per_call_us(lambda: torch.nn.functional.linear(x, w))
    add = per_call_us(lambda: torch.add(a, b))
    print(f"{label:58s} {torch.get_num_threads()} threads: GEMV {gemv:6.1f} us, add {add:6.1f} us", flush=True)


def in_thread(label: str) -> None:
    worker = threading.Thread(target=measure, args=(label,))
    worker.start()
    worker.join()


def main() -> int:
    in_thread("a lone thread (the main thread has run no op)")
    in_thread("a second thread after the first one exited")
    measure("the main thread")
    in_thread("a thread after the main thread ran ops (the engine loop's)")
    torch.set_num_threads(1)
    in_thread("the same with one torch thread")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
