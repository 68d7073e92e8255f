"""GPU kernel benchmarks: `python bench/kernels.py {turbo,experts,rotation,all}`.

Each suite lives in its own module (bench/kernels_turbo.py, bench/kernels_experts.py) and
exposes ``run(device, copy_gbs) -> (title, rows)``; this dispatcher measures the device copy
bandwidth once, runs the chosen suites, prints their tables and records them in
docs/BENCHMARKS.md (see bench/harness.py). On a machine that only returns files written to
$OUT, finish with `cp docs/BENCHMARKS.md $OUT/` and bring the new blocks home.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from pathlib import Path

# Run as a script from anywhere: make `bench.*` and `server.*` importable from the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import BENCHMARKS_DOC, copy_bandwidth_gbs, report, require_gpu  # noqa: E402

SUITES = {"turbo": "bench.kernels_turbo", "experts": "bench.kernels_experts", "rotation": "bench.kernels_rotation"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", choices=[*SUITES, "all"], help="which kernel family to benchmark")
    parser.add_argument("--no-record", action="store_true", help="print the tables without writing docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    device = require_gpu()
    copy_gbs = copy_bandwidth_gbs(device)
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    command = "python bench/kernels.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    names = list(SUITES) if args.suite == "all" else [args.suite]
    failed = []
    for name in names:
        try:
            module = importlib.import_module(SUITES[name])
        except ModuleNotFoundError as exc:
            if exc.name != SUITES[name]:
                raise
            print(f"bench: suite {name!r} has no module yet ({SUITES[name]}); skipped", file=sys.stderr)
            failed.append(name)
            continue
        title, rows = module.run(device, copy_gbs)
        report(title, rows, copy_gbs, command, device=device, doc_path=None if args.no_record else BENCHMARKS_DOC)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
