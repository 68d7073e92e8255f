"""bench/harness.py: the arithmetic and bookkeeping behind every kernel-benchmark row."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.harness import Row, format_table, report, rotation_count, time_ms

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_kernel_bench_refuses_to_run_without_gpu():
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "kernels.py"), "all"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0, f"expected a non-zero exit on CPU, got 0; stdout={proc.stdout!r}"
    assert "needs a GPU" in proc.stderr, proc.stderr


# Absent on the GPU machine (shared/ENVIRONMENT.md): the kernel benchmarks must not need them.
SERVING_ONLY_MODULES = ("fastapi", "uvicorn", "pydantic", "gguf", "openai", "httpx")


def test_kernel_benchmarks_import_without_serving_dependencies():
    suites = [m for m in ("bench.kernels", "bench.kernels_turbo", "bench.kernels_experts")
              if (REPO / (m.replace(".", "/") + ".py")).exists()]  # fmt: skip
    code = (
        f"import sys, importlib\nfor m in {SERVING_ONLY_MODULES!r}: sys.modules[m] = None\n"
        f"for m in {suites!r}: importlib.import_module(m)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"importing {suites} needed a serving-only module:\n{proc.stderr[-3000:]}"


def test_time_ms_rotates_inputs_and_excludes_warmup():
    calls = []

    def fn(i):
        calls.append(i)
        # The warm-up calls are slow (like a first compile); the timed ones are fast.
        time.sleep(0.05 if len(calls) <= 3 else 0.001)

    ms = time_ms(fn, n_inputs=4, warmup=3, iters=9, device=torch.device("cpu"))
    assert calls == [i % 4 for i in range(3)] + [i % 4 for i in range(9)], calls
    assert 0.9 <= ms < 20, f"median {ms} ms should reflect the 1 ms timed calls, not the 50 ms warm-up"


def test_time_ms_rejects_bad_counts():
    with pytest.raises(ValueError, match="n_inputs >= 1"):
        time_ms(lambda i: None, n_inputs=0)


def test_rotation_spans_twice_the_cache():
    cpu = torch.device("cpu")
    assert rotation_count(1 << 30, cpu) == 1
    assert rotation_count(32 << 20, cpu) == 4  # 2 x 64 MiB default / 32 MiB
    assert rotation_count(1 << 10, cpu) == 64  # capped


def test_row_derived_numbers():
    row = Row("decode", ours_ms=0.5, baseline_ms=2.0, bytes_moved=2_000_000_000)
    assert row.speedup == pytest.approx(4.0)
    assert row.achieved_gbs == pytest.approx(4000.0)  # 2 GB in 0.5 ms
    assert row.fraction_of_copy(5000.0) == pytest.approx(0.8)
    bare = Row("no-baseline", ours_ms=1.0)
    assert bare.speedup is None and bare.achieved_gbs is None and bare.fraction_of_copy(1.0) is None
    table = format_table([row, bare], copy_gbs=5000.0)
    assert "| decode | 0.5000 | - | 2.0000 | 4.00x | 4000 | 80% |" in table, table


def test_report_puts_the_newest_block_first_in_the_kernels_section(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# B\n\n## Kernels\n\nIntro.\n\n### older (2026-01-01 00:00 UTC)\n\nold\n\n## End to end\n\nE2E.\n")
    cpu = torch.device("cpu")
    report("first", [Row("a", 1.0)], 100.0, "python bench/kernels.py turbo", device=cpu, doc_path=doc)
    report("second", [Row("b", 2.0)], 100.0, "python bench/kernels.py experts", device=cpu, doc_path=doc)
    text = doc.read_text()
    order = ("## Kernels", "Intro.", "### second", "### first", "### older", "## End to end", "E2E.")
    positions = [text.index(s) for s in order]
    assert positions == sorted(positions), text
    assert "- Command: `python bench/kernels.py turbo`" in text
    assert "- Measured device copy bandwidth: 100 GB/s" in text
    assert " UTC)" in text and "Hardware: CPU, torch " in text


def test_report_creates_a_missing_kernels_section(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# B\n\n## Quality\n\nq\n")
    report("only", [Row("a", 1.0)], 100.0, "python bench/kernels.py turbo", device=torch.device("cpu"), doc_path=doc)
    text = doc.read_text()
    assert text.index("## Quality") < text.index("## Kernels") < text.index("### only"), text


def test_report_refuses_empty_rows(tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        report("t", [], 1.0, "cmd", device=torch.device("cpu"), doc_path=tmp_path / "x.md")


def test_dispatcher_runs_suites_and_reports_missing_ones(monkeypatch, tmp_path, capsys):
    import types

    import bench.kernels as kernels

    seen = {}

    def run(device, copy_gbs):
        seen["args"] = (device, copy_gbs)
        return "Fake suite", [Row("case-1", ours_ms=2.0, baseline_ms=4.0)]

    monkeypatch.setitem(sys.modules, "fake_suite", types.SimpleNamespace(run=run))
    monkeypatch.setattr(kernels, "SUITES", {"turbo": "fake_suite", "experts": "no_such_suite_module"})
    monkeypatch.setattr(kernels, "require_gpu", lambda: torch.device("cpu"))
    monkeypatch.setattr(kernels, "copy_bandwidth_gbs", lambda device: 1234.0)
    doc = tmp_path / "B.md"
    monkeypatch.setattr(kernels, "BENCHMARKS_DOC", doc)
    assert kernels.main(["turbo"]) == 0
    assert seen["args"] == (torch.device("cpu"), 1234.0)
    assert "### Fake suite" in doc.read_text() and "| case-1 | 2.0000 |" in doc.read_text()
    assert kernels.main(["all", "--no-record"]) == 1  # the experts suite is missing
    captured = capsys.readouterr()
    assert "suite 'experts' has no module yet" in captured.err
    assert doc.read_text().count("### Fake suite") == 1  # --no-record wrote nothing


def test_the_recorded_commit_says_when_the_files_are_not_that_commit(tmp_path, monkeypatch):
    from bench.harness import _git_commit

    monkeypatch.delenv("TURBOSERVE_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.txt").write_text("one\n")
    subprocess.run([*git, "-C", str(tmp_path), "add", "a.txt"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-qm", "first"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert _git_commit(tmp_path) == head
    (tmp_path / "a.txt").write_text("two\n")
    assert _git_commit(tmp_path) == f"{head} + uncommitted changes"
    monkeypatch.setenv("TURBOSERVE_COMMIT", "abc1234")
    assert _git_commit(tmp_path) == "abc1234"
