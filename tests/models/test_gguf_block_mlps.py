"""GGUF MLPs stored in llama.cpp's 1- and 2-bit blocks (q1_0 = type 41, q2_0 = type 42) load as is.

Tiny random models are written as GGUF files whose expert (and dense / shared-expert MLP) tensors are
q1_0 / q2_0 blocks made by a small encoder of this file. The loader must swap in the quantized expert
modules built from those very bytes -- no dequantized copy, no rotation (GGUF blocks are plain) -- and the
model must compute what the same model computes in float64 with the blocks decoded here, independently.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_batch import PagedBatch, greedy
from server.kernels.experts import qblocks
from server.kernels.experts.modules import QuantizedExperts, QuantizedMLP
from server.runtime.models.loader import load_model
from test_gguf_architectures import write_gguf
from tiny_checkpoints import PROMPTS, make_checkpoint

TYPE_ID = {"q1_0": 41, "q2_0": 42}  # ggml's numbering (ggml.h), written here by hand
BLOCK = {"q1_0": 128, "q2_0": 64}


def encode_blocks(w: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows of w [..., K] -> (GGUF bytes [..., K/block * 18] uint8, the weights they decode to, float64).

    A block is its fp16 scale d (little-endian), then 16 bytes of codes, weight j in bits LSB first:
    q1_0: 1 bit, +d if set else -d; q2_0: 2 bits, (code - 1) * d. q2_0 picks d's sign so that the
    lone level 2·d falls on the larger side of the block (so both signs of d occur).
    """
    block = BLOCK[fmt]
    b = w.astype(np.float64).reshape(*w.shape[:-1], -1, block)
    if fmt == "q1_0":
        d = np.abs(b).mean(-1).astype(np.float16)
        codes = (b >= 0).astype(np.uint8)
        levels = 2.0 * codes - 1
        packed = np.packbits(codes, axis=-1, bitorder="little")
    else:
        hi, lo = b.max(-1), -b.min(-1)
        d = np.where(hi >= lo, np.maximum(hi / 2, lo), -np.maximum(lo / 2, hi)).astype(np.float16)
        codes = np.clip(np.round(b / d.astype(np.float64)[..., None]) + 1, 0, 3).astype(np.uint8)
        levels = codes - 1.0
        quads = codes.reshape(*codes.shape[:-1], 16, 4)
        packed = (quads[..., 0] | quads[..., 1] << 2 | quads[..., 2] << 4 | quads[..., 3] << 6).astype(np.uint8)
    scale_bytes = d.astype("<f2").view(np.uint8).reshape(*d.shape, 2)
    raw = np.concatenate([scale_bytes, packed], -1).reshape(*w.shape[:-1], -1)
    return raw, (levels * d.astype(np.float64)[..., None]).reshape(w.shape)


def tensor_writer(plan: dict[str, str], decoded: bool):
    """write_gguf's add_tensor: tensors whose name contains a key of ``plan`` go out in that block format
    (``decoded``: as the F32 weights those blocks decode to instead), the rest as F32."""

    def add(writer, name: str, a: np.ndarray) -> None:
        fmt = next((f for part, f in plan.items() if f".{part}." in name), None)
        if fmt is None:
            writer.add_tensor(name, a)
            return
        raw, weights = encode_blocks(a, fmt)
        if decoded:
            writer.add_tensor(name, weights.astype(np.float32))  # exact: fp16 d times a small integer
        else:
            # gguf's writer derives a block tensor's shape from its bytes only for types it knows; given
            # bytes of another dtype (int8) and the logical shape, it writes both and the type id as they are.
            writer.add_tensor(name, raw.view(np.int8), raw_shape=a.shape, raw_dtype=TYPE_ID[fmt])

    return add


WIDE = dict(hidden_size=128, intermediate_size=128)
CASES = {
    # name: (checkpoint, overrides, plan: tensor name part -> format, modules that must be quantized)
    "qwen3_moe experts q2_0 gate/up, q1_0 down": (
        "qwen3_moe", dict(WIDE, moe_intermediate_size=128),
        {"ffn_gate_exps": "q2_0", "ffn_up_exps": "q2_0", "ffn_down_exps": "q1_0"},
        {"layers.0.mlp.experts": QuantizedExperts, "layers.1.mlp.experts": QuantizedExperts},
    ),
    "qwen2_moe experts q1_0/q2_0, shared expert q2_0": (
        "qwen2_moe", dict(WIDE, moe_intermediate_size=64, shared_expert_intermediate_size=64, mlp_only_layers=[]),
        {"ffn_gate_exps": "q1_0", "ffn_up_exps": "q1_0", "ffn_down_exps": "q2_0",
         "ffn_gate_shexp": "q2_0", "ffn_up_shexp": "q2_0", "ffn_down_shexp": "q2_0"},
        {f"layers.{i}.mlp.{m}": cls for i in (0, 1)
         for m, cls in (("experts", QuantizedExperts), ("shared_expert", QuantizedMLP))},
    ),
    "qwen3 dense MLPs q1_0": (
        "qwen3", WIDE, {"ffn_gate": "q1_0", "ffn_up": "q1_0", "ffn_down": "q1_0"},
        {"layers.0.mlp": QuantizedMLP, "layers.1.mlp": QuantizedMLP},
    ),
    # Only gate in blocks: gate and up cannot form one [gate; up] block matrix, so the layer is dequantized.
    "qwen3_moe gate only q2_0: dequantized": (
        "qwen3_moe", dict(WIDE, moe_intermediate_size=128), {"ffn_gate_exps": "q2_0"}, {},
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def files(request, tmp_path_factory):
    """(GGUF with block MLPs, the same model with those blocks decoded to F32, plan, expected modules)."""
    ckpt, overrides, plan, modules = CASES[request.param]
    tmp = tmp_path_factory.mktemp("gguf_blocks")
    hf_model = make_checkpoint(ckpt, str(tmp / "hf"), seed=5, **overrides)
    paths = {}
    for kind in ("blocks", "decoded"):
        paths[kind] = str(tmp / f"{kind}.gguf")
        write_gguf(hf_model, hf_model.config.model_type, paths[kind], tensor_writer(plan, kind == "decoded"))
    return paths, plan, modules


def _logits(model, kv_dtype) -> list[torch.Tensor]:
    """Prefill both prompts in one step, then one decode token each: every new token's logits."""
    batch = PagedBatch(model, kv_dtype=kv_dtype)
    steps = [{"a": PROMPTS["a"], "b": PROMPTS["b"]}, {"a": [5], "b": [7]}]
    return [t for step in steps for t in batch.step(step).values()]


def test_block_mlps_are_used_as_is_and_compute_the_float64_model(files, monkeypatch):
    paths, plan, want_modules = files
    decoded_calls = []
    real_dequantize = qblocks.dequantize
    monkeypatch.setattr(qblocks, "dequantize", lambda *a, **k: decoded_calls.append(1) or real_dequantize(*a, **k))
    ours = load_model(paths["blocks"], torch.device("cpu"), torch.float32)
    monkeypatch.undo()

    # (a) the quantized modules, holding the file's bytes; nothing decoded to a dense copy at load.
    if want_modules:
        assert not decoded_calls, "block MLPs were dequantized while loading"
    for name, cls in want_modules.items():
        module = ours.model.get_submodule(name)
        assert type(module) is cls, f"{name} is {type(module).__name__}"
        experts = module if cls is QuantizedExperts else module.experts
        for role in ("gate_up", "down"):
            w = experts.weights(role)
            assert w.signs is None and w.group == 0, f"{name}.{role}: GGUF blocks must not be rotated"
            assert w.format in ("q1_0", "q2_0") and w.tensors["codes"].dtype == torch.uint8
    expert_params = [n for n, _ in ours.model.named_parameters() if n.rsplit(".", 2)[0] in want_modules
                     or n.rsplit(".", 3)[0] in want_modules]
    assert not expert_params, f"dense copies of quantized MLPs exist: {expert_params}"
    raw_types = {raw.ggml_type.name for raw in ours.raw_weights.values()}
    assert raw_types == {fmt.upper() for fmt in plan.values()}
    if not want_modules:  # the fallback: the dense Experts module, decoded by our block decoder
        assert type(ours.model.layers[0].mlp.experts).__name__ == "Experts" and decoded_calls

    # (b) the same logits as the float64 model whose weights are the blocks decoded by encode_blocks.
    reference = load_model(paths["decoded"], torch.device("cpu"), torch.float64)
    got, want = _logits(ours.model, torch.float32), _logits(reference.model, torch.float64)
    for g, w in zip(got, want):
        scale = w.abs().max().item()
        assert (g.double() - w).abs().max().item() <= 1e-5 * scale, "logits differ from the float64 model"


def test_block_expert_bytes_are_the_files():
    """The packed codes and scales the module multiplies are the file's blocks, byte for byte."""
    w = np.random.default_rng(0).standard_normal((3, 5, 256)).astype(np.float32)
    for fmt in ("q1_0", "q2_0"):
        raw, weights = encode_blocks(w, fmt)
        from server.kernels.experts.weights import from_gguf

        q = from_gguf(fmt, torch.from_numpy(raw.reshape(-1).copy()), 5, 256)
        assert q.signs is None and q.rotate_input(torch.ones(2, 256)).equal(torch.ones(2, 256))
        assert torch.equal(q.dequantize(dtype=torch.float64), torch.from_numpy(weights))


def test_engine_serves_a_block_expert_gguf(tmp_path):
    from server.config import EngineConfig
    from server.runtime.engine import Engine
    from server.runtime.sequence import SamplingParams

    ckpt, overrides, plan, _ = CASES["qwen3_moe experts q2_0 gate/up, q1_0 down"]
    hf_model = make_checkpoint(ckpt, str(tmp_path / "hf"), seed=6, **overrides)
    paths = {kind: str(tmp_path / f"{kind}.gguf") for kind in ("blocks", "decoded")}
    for kind, path in paths.items():
        write_gguf(hf_model, "qwen3_moe", path, tensor_writer(plan, kind == "decoded"))
    engine = Engine(EngineConfig(model=paths["blocks"], device="cpu", dtype="float32",
                                 kv_cache_memory=1 << 20, max_model_len=64))
    try:
        assert isinstance(engine.model.layers[0].mlp.experts, QuantizedExperts)
        result = engine.generate(PROMPTS["b"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    finally:
        engine.shutdown()
    reference = load_model(paths["decoded"], torch.device("cpu"), torch.float64)
    want, _ = greedy(PagedBatch(reference.model, kv_dtype=torch.float64), {"b": PROMPTS["b"]}, 5)
    assert result.finish_reason == "length" and result.token_ids == want["b"]


@pytest.mark.parametrize("type_id,match", [(43, "has GGML type 43, which neither"),
                                           (42, "q2_0 rows must be whole blocks of 64, got 96")])
def test_unreadable_block_tensors_are_refused_clearly(tmp_path, type_id, match):
    hf_model = make_checkpoint("qwen3", str(tmp_path / "hf"), seed=1)  # intermediate 96: not whole q2_0 blocks

    def add(writer, name, a):
        if ".ffn_down." not in name:
            writer.add_tensor(name, a)
            return
        raw = np.zeros((*a.shape[:-1], 2 * 18), dtype=np.int8)  # what 96 weights would need as q2_0, rounded up
        writer.add_tensor(name, raw, raw_shape=a.shape, raw_dtype=type_id)

    path = str(tmp_path / "bad.gguf")
    write_gguf(hf_model, "qwen3", path, add)
    with pytest.raises(ValueError, match=match):
        load_model(path, torch.device("cpu"), torch.float32)
