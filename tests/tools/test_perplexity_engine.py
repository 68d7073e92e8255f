"""`turboserve perplexity` through the real engine, checked against transformers on the same tokens."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from server.config import EngineConfig
from server.tools.corpus import lee_corpus_path
from server.tools.perplexity import PerplexityError, measure_perplexity

CTX, CHUNKS = 64, 3


@pytest.fixture(scope="module")
def engine():
    from server.runtime.engine import Engine

    # The float32 weights and products transformers multiplies too (not the 4-bit blocks, nor bfloat16 prompts or
    # LM head on a CPU that multiplies bfloat16 natively): the tool's bookkeeping is under test
    engine = Engine(EngineConfig(device="cpu", dtype="float32", kv_cache_memory=32 << 20, max_model_len=256,
                                 cpu_int4=False, cpu_prompt_dtype="float32", cpu_logits_dtype="float32"))  # fmt: skip
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def text():
    return lee_corpus_path().read_text(encoding="utf-8")[:20_000]


def transformers_nlls(token_windows: list[list[int]]) -> list[np.ndarray]:
    """Per-window NLLs of the second half, computed by transformers from the same GGUF file."""
    from transformers import AutoModelForCausalLM

    from server.runtime.models.loader import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)  # fmt: skip
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(token_windows)).logits.double()
    logp = torch.log_softmax(logits, dim=-1)
    first = CTX // 2
    out = []
    for w, window in enumerate(token_windows):
        # logits at position j predict token j + 1; score tokens first+1 .. CTX-1
        nll = [-logp[w, j - 1, window[j]].item() for j in range(first + 1, CTX)]
        out.append(np.array(nll))
    return out


def test_perplexity_matches_transformers_on_the_same_tokens(engine, text):
    result = measure_perplexity(engine, text, ctx=CTX, max_chunks=CHUNKS)
    ids = engine.tokenizer.encode(text)
    assert ids[0] != engine.tokenizer.bos_token_id  # SmolLM2 adds no BOS, so windows are plain slices
    windows = [ids[i * CTX : (i + 1) * CTX] for i in range(CHUNKS)]
    nlls = transformers_nlls(windows)
    all_nll = np.concatenate(nlls)
    expected_ppl = math.exp(all_nll.mean())
    expected_err = expected_ppl * all_nll.std() / math.sqrt(len(all_nll) - 1)
    assert result.n_scored_tokens == CHUNKS * (CTX - CTX // 2 - 1) == len(all_nll)
    assert result.ppl == pytest.approx(expected_ppl, rel=1e-4), (result.ppl, expected_ppl)
    assert result.ppl_error == pytest.approx(expected_err, rel=1e-4), (result.ppl_error, expected_err)
    assert result.chunk_ppls == pytest.approx([math.exp(n.mean()) for n in nlls], rel=1e-4)


def test_context_above_the_engine_is_a_clear_error(engine, text):
    with pytest.raises(PerplexityError, match=r"--ctx 256 is above the context the engine serves \(256 tokens"):
        measure_perplexity(engine, text, ctx=256)


def test_text_shorter_than_a_window_is_a_clear_error(engine):
    with pytest.raises(PerplexityError, match="shorter than one window of --ctx 64"):
        measure_perplexity(engine, "Just a few words.", ctx=CTX)


def test_cli_prints_chunks_and_final_line_and_writes_json(engine, text, tmp_path):
    src = tmp_path / "text.txt"
    src.write_text(text)
    out = tmp_path / "ppl.json"
    cmd = [sys.executable, "-m", "server", "perplexity", "--device", "cpu", "--dtype", "float32",
           "--kv-cache-memory", "32MiB", "--max-model-len", "256", "--file", str(src), "--ctx", str(CTX),
           "--chunks", "2", "--json", str(out), "--no-cpu-int4", "--cpu-prompt-dtype", "float32",
           "--cpu-logits-dtype", "float32"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = measure_perplexity(engine, text, ctx=CTX, max_chunks=2)
    assert f"PPL = {expected.ppl:.4f} +/- " in proc.stdout, proc.stdout
    assert proc.stdout.count("chunk PPL") == 2, proc.stdout
    saved = json.loads(out.read_text())
    assert saved["ppl"] == pytest.approx(expected.ppl, rel=1e-6) and saved["n_chunks"] == 2
    assert saved["engine_config"]["kv_cache_dtype"] == "auto" and saved["file"] == str(src)
    assert saved["engine_config"]["cpu_int4"] is False and saved["engine_config"]["cpu_prompt_dtype"] == "float32"
    assert saved["engine_config"]["cpu_logits_dtype"] == "float32"


def test_cli_missing_file_fails_before_loading_the_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "server", "perplexity", "--file", str(tmp_path / "nope.txt")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "nope.txt: no such file" in proc.stderr, proc.stderr


def test_cli_bad_engine_flags_are_a_clear_error_not_a_traceback(tmp_path):
    src = tmp_path / "text.txt"
    src.write_text("words " * 100)
    cmd = [sys.executable, "-m", "server", "perplexity", "--device", "cpu", "--kv-cache-dtype", "turbo3",
           "--kv-recent-window", "-5", "--file", str(src)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and "cannot start: recent window -5" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_kv_pool_too_small_for_one_window_is_a_clear_error(engine, text):
    from server.runtime.engine import Engine
    from server.runtime.models.loader import LoadedModel

    same_model = LoadedModel(engine.model, engine.tokenizer, engine.model_config, engine.model_name, "reused")
    small = Engine(EngineConfig(device="cpu", dtype="float32", kv_cache_memory=1 << 20, max_model_len=256), same_model)
    try:
        with pytest.raises(PerplexityError, match=r"refused a window of 64 tokens: .*--kv-cache-memory"):
            measure_perplexity(small, text, ctx=CTX)
    finally:
        small.shutdown()
