"""`turboserve quantize [--model M] --format FMT --out DIR`: quantize a model's MoE experts (specs/expert-formats.md).

Every routed-expert stack (and, with --include-dense-mlp, every dense SwiGLU MLP, stored as a
one-expert MoE) is rotated, quantized and written to DIR with the format's metadata; all other
weights stay in the base model, which DIR names. `turboserve serve --model DIR` serves it.
"""

from __future__ import annotations

import argparse
import os
import sys

FORMATS = ("e8p", "e8p3", "q1_0", "q2_0", "bf16")


def register(subparsers) -> None:
    p = subparsers.add_parser("quantize", help="quantize MoE experts (and dense MLPs) to e8p/e8p3/q1_0/q2_0")
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: the embedded SmolLM2)")
    p.add_argument("--format", required=True, choices=FORMATS, help="weight format of the quantized MLPs")
    p.add_argument("--out", required=True, help="directory to write (quantization.json + experts.safetensors)")
    p.add_argument("--include-dense-mlp", action="store_true", help="also quantize dense MLPs as one-expert MoEs")
    p.add_argument("--device", default="cpu", help="where the encoder runs (cuda is much faster for e8p/e8p3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the rotations' random signs")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        written = quantize_model(args.model, args.format, args.out, args.include_dense_mlp, args.device, args.seed)
    except (ValueError, FileNotFoundError) as exc:
        print(f"turboserve quantize: {exc}", file=sys.stderr)
        return 2
    from server.kernels.experts.weights import bits_per_weight

    print(f"wrote {written} quantized MLP module(s) in {args.format} ({bits_per_weight(args.format)} bits/weight) "
          f"to {args.out}; serve with `turboserve serve --model {args.out}`")
    return 0


def quantize_model(model: str | None, fmt: str, out: str, include_dense_mlp: bool = False,
                   device: str = "cpu", seed: int = 0) -> int:
    """Quantize and write; returns how many modules were quantized. Raises ValueError on what cannot be done."""
    import torch
    from tqdm import tqdm

    from server.kernels.experts import checkpoint, weights
    from server.runtime.models.llama import DenseMLP
    from server.runtime.models.loader import load_model
    from server.runtime.models.moe import Experts

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if model is not None and checkpoint.is_quantized_dir(model):
        raise ValueError(f"{model} is already quantized; pass the original model")
    loaded = load_model(model, torch.device("cpu"), torch.float32)
    targets = []
    for i, layer in enumerate(loaded.model.layers):
        mlp = layer.mlp
        if isinstance(getattr(mlp, "experts", None), Experts):
            targets.append((f"layers.{i}.mlp.experts", "experts", mlp.experts.gate_up_proj, mlp.experts.down_proj))
        elif isinstance(mlp, DenseMLP) and include_dense_mlp:
            targets.append((f"layers.{i}.mlp", "mlp", mlp.gate_up_proj.weight[None], mlp.down_proj.weight[None]))
    if not targets:
        raise ValueError(f"{loaded.name} has no MoE experts to quantize; pass --include-dense-mlp to quantize its dense MLPs")
    for name, _, gate_up, down in targets:  # refuse before any long work
        for what, w in (("gate_up (input = hidden size)", gate_up), ("down (input = intermediate size)", down)):
            try:
                weights.check_shape(fmt, w.shape[-1])
            except ValueError as exc:
                raise ValueError(f"{name} {what}: {exc}") from None
    modules = {}
    for n, (name, kind, gate_up, down) in enumerate(tqdm(targets, desc=f"quantizing to {fmt}", unit="module")):
        parts = [weights.quantize(w.detach().to(device), fmt, seed=seed * 1_000_003 + 2 * n + j).to("cpu")
                 for j, w in enumerate((gate_up, down))]
        modules[name] = (kind, *parts)
    base = None if model is None else os.path.abspath(model)
    checkpoint.save(out, fmt, base, f"{loaded.name}-{fmt}", modules)
    return len(modules)
