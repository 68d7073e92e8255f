"""`turboserve bench serve` against a scripted SSE endpoint whose timings are known in advance."""

import json
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from server.tools.bench_serve import BenchConfig, arrival_delays, build_prompts, run_benchmark

FIRST_DELAY_S = 0.15  # before the first content chunk
GAP_S = 0.05  # between content chunks
CHUNKS = 4


class ScriptedCompletions(BaseHTTPRequestHandler):
    """Streams CHUNKS text chunks with fixed delays; request bodies are kept for inspection."""

    bodies: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._json(200, {"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ScriptedCompletions.bodies.append(body)
        if self.headers.get("Authorization") != "Bearer k":
            return self._json(401, {"error": {"message": "bad key", "type": "authentication_error"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(FIRST_DELAY_S)
        for i in range(CHUNKS):
            if i:
                time.sleep(GAP_S)
            self._event({"choices": [{"index": 0, "text": f"t{i}"}]})
        self._event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": CHUNKS}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True

    def _event(self, obj):
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def _json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def scripted_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_latencies_match_the_scripted_stream(scripted_url):
    import asyncio

    ScriptedCompletions.bodies.clear()
    cfg = BenchConfig(base_url=scripted_url, api_key="k", num_prompts=3, concurrency=3, input_len=5, output_len=7,
                      progress=False)  # fmt: skip
    summary = asyncio.run(run_benchmark(cfg))
    assert (summary["completed"], summary["failed"]) == (3, 0), summary["errors"]
    assert summary["config"]["model"] == "scripted"  # picked from /v1/models
    assert summary["output_tokens"] == 3 * CHUNKS and summary["prompt_tokens"] == 9
    ttft = summary["ttft_ms"]["mean"]
    assert FIRST_DELAY_S * 1e3 <= ttft < FIRST_DELAY_S * 1e3 + 150, ttft
    itl = summary["itl_ms"]["p50"]
    assert GAP_S * 1e3 * 0.9 <= itl < GAP_S * 1e3 + 60, itl
    # TPOT spreads E2E - TTFT over the tokens after the first: (CHUNKS-1) gaps.
    assert GAP_S * 1e3 * 0.9 <= summary["tpot_ms"]["mean"] < GAP_S * 1e3 + 60
    assert summary["e2e_ms"]["p99"] >= (FIRST_DELAY_S + (CHUNKS - 1) * GAP_S) * 1e3
    body = ScriptedCompletions.bodies[0]
    assert body["stream"] is True and body["max_tokens"] == 7 and len(body["prompt"]) == 5


def test_http_errors_are_counted_with_the_server_message(scripted_url):
    import asyncio

    cfg = BenchConfig(base_url=scripted_url, model="scripted", api_key="wrong", num_prompts=2, progress=False)
    summary = asyncio.run(run_benchmark(cfg))
    assert summary["completed"] == 0 and summary["failed"] == 2
    assert summary["errors"] == {"HTTP 401: bad key": 2}


def test_random_prompts_are_seeded_and_exact_length():
    a = build_prompts(BenchConfig(base_url="x", num_prompts=4, input_len=9, seed=3))
    b = build_prompts(BenchConfig(base_url="x", num_prompts=4, input_len=9, seed=3))
    assert a == b and all(len(p) == 9 for p in a) and a[0] != a[1]


def test_prompts_file_lines_and_jsonl(tmp_path):
    plain = tmp_path / "p.txt"
    plain.write_text("alpha\n\nbeta\n")
    assert sorted(build_prompts(BenchConfig(base_url="x", num_prompts=4, prompts_file=str(plain)))) == [
        "alpha", "alpha", "beta", "beta"]  # fmt: skip
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: expected a JSON object with a 'prompt'"):
        build_prompts(BenchConfig(base_url="x", prompts_file=str(bad)))


def test_poisson_arrivals_have_the_requested_rate():
    delays = arrival_delays(4000, rate=20.0, seed=0)
    assert statistics.fmean(delays) == pytest.approx(1 / 20.0, rel=0.05)
    # exponential gaps: standard deviation equals the mean
    assert statistics.pstdev(delays) == pytest.approx(1 / 20.0, rel=0.08)
    assert arrival_delays(3, rate=float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_cli_unreachable_server_is_a_clear_error(capsys):
    from server.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:1/v1", "--no-progress"])
    assert args.func(args) == 2
    assert "cannot reach http://127.0.0.1:1/v1" in capsys.readouterr().err


def test_cli_writes_json(scripted_url, tmp_path, capsys):
    from server.cli import build_parser

    out = tmp_path / "r.json"
    argv = ["bench", "serve", "--base-url", scripted_url, "--api-key", "k", "--num-prompts", "2", "--input-len", "3",
            "--output-len", "4", "--request-rate", "50", "--no-progress", "--json", str(out)]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "2 completed, 0 failed" in printed and "TTFT" in printed
    saved = json.loads(out.read_text())
    assert saved["completed"] == 2 and len(saved["requests"]) == 2 and saved["config"]["request_rate"] == 50
