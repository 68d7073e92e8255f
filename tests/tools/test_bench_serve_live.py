"""`turboserve bench serve` against a real turboserve (uvicorn + embedded SmolLM2) at tiny size."""

import json

import pytest

from tests.api.live_server import start_server, stop_server


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("bench") / "server.log", "--api-key", "bench-key")
    yield server
    stop_server(server)


def run_cli(argv):
    from server.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--no-progress", *argv])
    return args.func(args)


def test_random_prompts_have_exact_lengths_and_every_metric_is_measured(live, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = run_cli(["--base-url", live.v1, "--api-key", "bench-key", "--num-prompts", "4", "--concurrency", "2",
                  "--input-len", "16", "--output-len", "5", "--seed", "1", "--json", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert rc == 0, printed
    summary = json.loads(out.read_text())
    assert (summary["completed"], summary["failed"]) == (4, 0), summary["errors"]
    # The server's own usage counts: token-array prompts make --input-len exact, ignore_eos --output-len.
    assert summary["prompt_tokens"] == 4 * 16 and summary["output_tokens"] == 4 * 5
    assert summary["config"]["model"] == "SmolLM2-135M-Instruct"
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        assert stats["mean"] > 0 and stats["p50"] <= stats["p90"] <= stats["p99"], (key, stats)
    assert summary["e2e_ms"]["p50"] >= summary["ttft_ms"]["p50"]
    assert "4 completed, 0 failed" in printed and "req/s" in printed


def test_prompts_file_and_wrong_key(live, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\nOnce upon a time\n")
    assert run_cli(["--base-url", live.v1, "--api-key", "bench-key", "--num-prompts", "2", "--output-len", "3",
                    "--prompts-file", str(prompts)]) == 0  # fmt: skip
    assert "2 completed, 0 failed" in capsys.readouterr().out
    assert run_cli(["--base-url", live.v1, "--model", "SmolLM2-135M-Instruct", "--api-key", "wrong",
                    "--num-prompts", "2", "--output-len", "3"]) == 1  # fmt: skip
    printed = capsys.readouterr().out
    assert "0 completed, 2 failed" in printed and "error x2: HTTP 401" in printed, printed
