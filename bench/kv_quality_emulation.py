"""Perplexity of the embedded model with its KV cache passed through the turbo format's reference quantizer,
under a choice of key offset: how much of the quality loss each offset recovers (CPU; docs/BENCHMARKS.md
"Quality" quotes it).

    OMP_NUM_THREADS=1 python bench/kv_quality_emulation.py --kinds turbo3,turbo4 --offsets fixed,partial8,turned
    OMP_NUM_THREADS=1 python bench/kv_quality_emulation.py --offsets partial8@ctx --balances off,1/8:1/4,1/4:1/4

Every K and V the model writes goes into a float32 dense cache as dequantize(quantize(x - o)) + o (format.py's
reference, specs/turboquant.md), with V's offset 0 and K's offset o one of
  none      0, the spec's plain format;
  fixed     the mean post-RoPE key of each (layer, KV head): `--kv-key-offset fixed`;
  turned    the mean pre-RoPE key turned to each key's position, and the calibration text's own key at
            position 0 (the attention sink): `--kv-key-offset turned`;
  partialP  turned on the P rotate-half pairs per KV head that gain most on the calibration text, fixed on
            the others; partialP@ctx: the pairs that gain most over --ctx positions (turned_pair_gains):
            `--kv-key-offset partial --kv-key-turned-pairs P`
            (server/kernels/turbo/key_offset.py, server/runtime/kv_calibration.py).
``--balances`` adds the K / V channel balance the engine folds in by default (server/runtime/kv_balance.py) at
chosen exponents "K:V" (the engine's: 1/8:1/4; "off" for none, what `--no-kv-balance` serves): K is stored as
s (k - o) and read back divided by s, V as t v, with s and t from the same calibration forward as the engine's
(the offset's pairs chosen on the unbalanced keys, where the engine chooses them on the balanced ones).
Offsets come from one forward over kv_calibration.CALIBRATION_TEXT, as the engine's. Windows and scoring are
the perplexity tool's (text_windows; the second half of each window scored), so each reproduces
`turboserve perplexity --kv-cache-dtype KIND --kv-key-offset ...` up to the engine's own arithmetic. Also printed: the mean
KL(exact model || emulated) over the scored tokens, steadier than perplexity for comparing offsets.
One sequence per forward, so a token's slot is its position.
"""

from __future__ import annotations

import argparse
import sys
from fractions import Fraction
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.kernels.paged_kv import AttentionMetadata, DenseKVStore  # noqa: E402
from server.kernels.turbo.format import dequantize_reference, quantize_reference  # noqa: E402
from server.kernels.turbo.key_offset import key_offset_at  # noqa: E402
from server.runtime.kv_calibration import CALIBRATION_TEXT, balance_scales, record_attention  # noqa: E402
from server.runtime.kv_calibration import key_offsets as calibrated_offsets  # noqa: E402
from server.runtime.models.loader import load_model  # noqa: E402
from server.tools.corpus import lee_corpus_path  # noqa: E402
from server.tools.perplexity import summarize, text_windows  # noqa: E402

PAGE = 16


class EmulatedCache:
    """One layer's float32 dense cache that stores what ``encode(layer, k, v, positions)`` gives back for the
    K and V it is written."""

    def __init__(self, layer: int, tokens: int, kv_heads: int, head_dim: int, encode):
        self.layer, self.encode, self.page_size = layer, encode, PAGE
        self.store = DenseKVStore(-(-tokens // PAGE), PAGE, kv_heads, head_dim, torch.float32, "cpu")

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor) -> None:
        self.store.write(*self.encode(self.layer, k.float(), v.float(), positions), slot_mapping, positions)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self.store.attend(q, meta, scale)


@torch.inference_mode()
def forward(model, tokens: list[int], encode, scored_from: int) -> torch.Tensor:
    """Log-probabilities of the next token at positions scored_from .. n - 2 of one sequence."""
    cfg, n = model.config, len(tokens)
    caches = [EmulatedCache(i, n, cfg.num_kv_heads, cfg.head_dim, encode) for i in range(cfg.num_layers)]
    pages = -(-n // PAGE)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(pages, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens_cpu=[n], query_lens_cpu=[n],
    )  # fmt: skip
    hidden = model.forward(torch.tensor(tokens), torch.arange(n), caches, meta)
    return torch.log_softmax(model.compute_logits(hidden[scored_from:-1]), dim=-1)


def key_offsets(model, tokenizer, names: list[str], ctx: int) -> dict:
    """offset name -> offset(layer, positions [T]) giving [T, kv_heads, D] (or 0.0)."""
    cfg = model.config
    args = (model, tokenizer.encode(CALIBRATION_TEXT), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
            torch.device("cpu"), torch.float32)
    pairs = {"fixed": 0, "turned": cfg.head_dim // 2}
    out = {}
    for name in names:
        if name == "none":
            out[name] = lambda layer, positions: 0.0
            continue
        count, _, context = name.removeprefix("partial").partition("@")
        if name not in pairs and not (name.startswith("partial") and count.isdigit() and context in ("", "ctx")):
            raise SystemExit(f"unknown offset {name!r}: none, fixed, turned, partialP or partialP@ctx")
        offsets = calibrated_offsets(*args, turned_pairs=pairs[name] if name in pairs else int(count),
                                     context=ctx if context else None)
        out[name] = lambda layer, positions, offsets=offsets: key_offset_at(offsets[layer], positions)
    return out


def channel_scales(model, tokenizer, offset, exponents: tuple[float, float]) -> list:
    """Per layer (K scales, V scales) [kv_heads, D] at ``exponents`` (K, V), measured as the engine does on the
    model as loaded, the keys less ``offset``."""
    cfg, ids = model.config, tokenizer.encode(CALIBRATION_TEXT)
    recorded = record_attention(model, ids, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.device("cpu"),
                                torch.float32)
    positions = torch.arange(len(ids))
    return [balance_scales(attention, r, offset(layer, positions), exponents)
            for layer, (r, attention) in enumerate(zip(recorded, model.attentions()))]


def exponent_pair(text: str) -> tuple[float, float] | None:
    """"K:V" with fractions allowed ("1/8:1/4") -> (K, V); "off" -> None."""
    if text == "off":
        return None
    try:
        k, v = (float(Fraction(x)) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"bad balance {text!r}: off or K:V exponents, e.g. 1/8:1/4") from None
    return k, v


def roundtrip(x: torch.Tensor, kind: str) -> torch.Tensor:
    return dequantize_reference(*quantize_reference(x, kind), kind, x.shape[-1])


def nll(logp: torch.Tensor, window: list[int], half: int) -> list[float]:
    """Negative log-likelihoods of the scored tokens from the log-probabilities of positions half .. ctx - 2."""
    targets = torch.tensor(window[half + 1 :])
    return (-logp.gather(1, targets[:, None]).squeeze(1)).tolist()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="turbo3", type=lambda s: s.split(","), help="e.g. turbo2,turbo3,turbo4")
    p.add_argument("--offsets", default="none,fixed,turned", type=lambda s: s.split(","),
                   help="none, fixed, turned, partialP (P rotate-half pairs per KV head turned, the rest fixed)")
    p.add_argument("--balances", default="off", type=lambda s: s.split(","),
                   help="K / V channel balance exponents K:V (the engine's 1/8:1/4) or off, comma-separated")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--file", type=Path, help="text to score (default: server/tools/corpus.py's corpus)")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_model(None, torch.device("cpu"), torch.float32)
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    text = (args.file or lee_corpus_path()).read_text()
    windows, n_text_tokens = text_windows(tokenizer, text, args.ctx, args.windows)
    offsets = key_offsets(model, tokenizer, args.offsets, args.ctx)
    half = args.ctx // 2  # scored: tokens half + 1 .. ctx - 1, as the perplexity tool
    exact = [forward(model, w, lambda layer, k, v, positions: (k, v), half) for w in windows]
    exact_ppl = summarize([nll(lp, w, half) for lp, w in zip(exact, windows)], args.ctx, n_text_tokens).ppl
    print(f"exact model (float32 cache): PPL {exact_ppl:.4f}", flush=True)
    for kind in args.kinds:
        for name in args.offsets:
            for balance in args.balances:
                offset, exponents = offsets[name], exponent_pair(balance)
                ones = [(1.0, 1.0)] * model.config.num_layers
                scales = ones if exponents is None else channel_scales(model, tokenizer, offset, exponents)

                def encode(layer, k, v, positions, kind=kind, offset=offset, scales=scales):
                    o, (s, t) = offset(layer, positions), scales[layer]
                    return roundtrip((k - o) * s, kind) / s + o, roundtrip(v * t, kind) / t

                nlls, kls = [], []
                for w, ref in zip(windows, exact):
                    logp = forward(model, w, encode, half)
                    nlls.append(nll(logp, w, half))
                    kls.append((ref.exp() * (ref - logp)).sum(-1).mean().item())
                result = summarize(nlls, args.ctx, n_text_tokens)
                print(f"{kind} K offset {name:9s} balance {balance:9s}: PPL {result.ppl:.4f} +/- "
                      f"{result.ppl_error:.4f} ({result.ppl / exact_ppl - 1:+.1%}), KL {sum(kls) / len(kls):.4f}, "
                      f"chunks {' '.join(f'{c:.2f}' for c in result.chunk_ppls)}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
