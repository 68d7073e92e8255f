"""`turboserve quantize` on tiny random Qwen3-MoE / Mixtral checkpoints, loaded back and served end to end."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "models"))
from paged_batch import PagedBatch  # noqa: E402
from tiny_checkpoints import PROMPTS, make_checkpoint  # noqa: E402

from server.kernels.experts.modules import QuantizedExperts  # noqa: E402
from server.tools.quantize import quantize_model  # noqa: E402
from server.runtime.models.loader import load_model  # noqa: E402

# Widths every format can hold (q1_0 packs 128 weights per block).
WIDE = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=128)
DISTORTION = {"e8p3": 0.0296, "e8p": 0.0916, "q2_0": 0.1175, "q1_0": 0.3634}


def _logits(path: str) -> torch.Tensor:
    loaded = load_model(path, torch.device("cpu"), torch.float32)
    return loaded, PagedBatch(loaded.model).step({"a": PROMPTS["a"]})["a"]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def base(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    overrides = {k: v for k, v in WIDE.items() if request.param == "qwen3_moe" or k != "moe_intermediate_size"}
    make_checkpoint(request.param, path, seed=3, **overrides)
    return path, _logits(path)[1]


def test_each_format_loads_and_its_logits_error_follows_its_distortion(base, tmp_path):
    path, want = base
    spread = (want - want.mean(-1, keepdim=True)).norm()
    errors = {}
    for fmt in DISTORTION:
        out = str(tmp_path / fmt)
        assert quantize_model(path, fmt, out) == 2  # two layers, each one expert stack
        loaded, got = _logits(out)
        assert isinstance(loaded.model.layers[0].mlp.experts, QuantizedExperts)
        errors[fmt] = ((got - want).norm() / spread).item()
    ratios = {f: errors[f] / math.sqrt(DISTORTION[f]) for f in errors}
    assert errors["e8p3"] < errors["e8p"] < errors["q1_0"], errors
    assert max(ratios.values()) < 3 * min(ratios.values()), f"logit error not in proportion to distortion: {ratios}"
    assert errors["e8p3"] < 0.5, errors


def test_quantized_directory_serves_through_the_engine(base, tmp_path):
    from server.config import EngineConfig
    from server.runtime.engine import Engine
    from server.runtime.sequence import SamplingParams

    path, _ = base
    out = str(tmp_path / "e8p3")
    quantize_model(path, "e8p3", out)
    engine = Engine(EngineConfig(model=out, device="cpu", dtype="float32", kv_cache_memory=1 << 20, max_model_len=64))
    try:
        result = engine.generate(PROMPTS["b"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    finally:
        engine.shutdown()
    assert result.finish_reason == "length" and len(result.token_ids) == 4
    assert engine.model_name.endswith("-e8p3")


def test_quantize_refuses_what_it_cannot_do(base, tmp_path):
    path, _ = base
    with pytest.raises(ValueError, match="unknown format 'q4_0'"):
        quantize_model(path, "q4_0", str(tmp_path / "x"))
    narrow = str(tmp_path / "narrow")
    make_checkpoint("mixtral", narrow, seed=1)  # hidden 64: not a whole q1_0 block
    with pytest.raises(ValueError, match="units of 128 weights; input width 64"):
        quantize_model(narrow, "q1_0", str(tmp_path / "y"))


def test_cli_quantizes_dense_mlps_only_when_asked(tmp_path, capsys):
    from server.cli import main

    dense = str(tmp_path / "dense")
    make_checkpoint("qwen3", dense, seed=2)  # hidden 64, intermediate 96: e8p-compatible widths
    out = str(tmp_path / "q")
    assert main(["quantize", "--model", dense, "--format", "e8p", "--out", out]) == 2
    assert "no MoE experts to quantize; pass --include-dense-mlp" in capsys.readouterr().err
    assert main(["quantize", "--model", dense, "--format", "e8p", "--out", out, "--include-dense-mlp"]) == 0
    assert "wrote 2 quantized MLP module(s) in e8p (2.0 bits/weight)" in capsys.readouterr().out
    loaded, logits = _logits(out)
    assert type(loaded.model.layers[1].mlp).__name__ == "QuantizedMLP" and torch.isfinite(logits).all()
