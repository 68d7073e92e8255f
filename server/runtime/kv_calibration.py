"""Key offsets for turbo K caches (server/kernels/turbo/key_offset.py) and the K / V channel balance
(server/runtime/kv_balance.py), measured once at start-up from one prefill over a built-in text.

A turbo K store quantizes k - o(p), o(p) = const + RoPE(p) mean (p >= 1), o(0) = sink. Every kind comes
from one forward pass over CALIBRATION_TEXT with a dense cache in the model's own dtype, leaving out the
first token, the attention sink, whose key is unlike the others. Per rotate-half pair f of a KV head the
keys k_f(p) (a complex number per pair) are summarized two ways:
  * c_f, the mean of the keys as written: a constant, which costs attention nothing (softmax ignores a
    shift every score of a row shares);
  * m_f, the mean of the keys turned back to position 0 (RoPE(-p) k): the shared direction is fixed
    before RoPE, so RoPE(p) m follows it at every position, but attention must add <q, RoPE(p) m>.
Over the n calibration keys the squared residual is sum |k_f|^2 - n |c_f|^2 with the constant and
sum |k_f|^2 - n |m_f|^2 with the turned mean, so turning pair f removes n (|m_f|^2 - |c_f|^2) more.
``turned_pairs`` P picks the P pairs of each KV head with the largest gain: they turn (mean = m there,
const = 0), the others keep c_f (mean = 0). The engine asks for the gain over its longest context
(turned_pair_gains): the calibration text is a few hundred tokens, and a pair too slow to turn within it
still turns over thousands (SmolLM2, turbo3, 8 pairs: perplexity +7.2 % chosen for 2048 positions, +9.0 %
by the calibration text's own gain, docs/BENCHMARKS.md "Quality"). P = 0 is ``--kv-key-offset fixed`` (the sink
is then c too: nothing varies with p, the fused decode does no extra work), P = D/2 ``turned``, in
between ``partial`` (decode attention dots only the P pairs); with P > 0 the sink is the first key itself.
Fixed per model (never per batch or sequence, so batch invariance holds), deterministic, and one
short prefill at start-up. A model without RoPE (``rope_inv_freq`` all zero) has m = c: no pair gains.
"""

from __future__ import annotations

import logging

import torch

from server.config import DEFAULT_KV_KEY_TURNED_PAIRS
from server.kernels.paged_kv import AttentionMetadata, DenseKVStore
from server.kernels.turbo.key_offset import KeyOffset, key_offset_at, pair_mask, rope_turn
from server.runtime.kv_balance import KEY_EXPONENT, VALUE_EXPONENT, key_scales, value_scales

log = logging.getLogger(__name__)

# Plain prose (written for this file): ordinary English text, numbers and a quotation.
CALIBRATION_TEXT = (
    'The harbour town woke slowly on the first cold morning of autumn. Fishing boats rocked against the pier '
    "while gulls argued over the remains of yesterday's catch, and the baker on the corner opened his "
    'shutters to let the smell of fresh bread drift down the street. Most of the people who lived there had '
    'done the same work for generations: they mended nets, repaired engines, sold fish at the market and kept'
    ' the small school running for the children who would one day take their place.\n\n'
    'In the library above the post office, a retired engineer was writing a history of the lighthouse. He had'
    ' found letters from the nineteenth century describing how the first lamp was carried up the hill by '
    'horse and cart, how the keepers recorded every passing ship in a leather book, and how a storm in 1887 '
    'broke every window in the tower. "We forget," he wrote, "that the light was never automatic. Someone had'
    ' to climb those stairs every evening, trim the wick and wind the clockwork, whatever the weather."\n\n'
    'The council meeting that evening discussed three questions: whether to widen the road to the station, '
    'how to pay for a new roof on the school, and what to do about the rising cost of fuel for the boats. The'
    ' treasurer presented a budget with 4 options, each costing between 12,000 and 35,000 pounds. After two '
    'hours of debate they agreed to ask the regional government for a grant, to postpone the road works until'
    ' spring, and to form a committee of five members to study the fuel problem.\n\n'
    'Scientists at the university nearby measured the temperature of the sea every week. Their data showed '
    'that the water had warmed by almost one degree over thirty years, and that some species of fish were '
    'moving north. A young researcher explained the results in simple terms to the fishermen: the ocean '
    'absorbs most of the extra heat trapped by greenhouse gases, so changes that are small on average can '
    'still move entire ecosystems.'
)
CALIBRATION_PAGE_SIZE = 16
SKIPPED_TOKENS = 1  # the attention sink


class _Recorder:
    """A dense store that keeps the last queries, keys and values it was given (one layer), in float32."""

    def __init__(self, store: DenseKVStore):
        self.store, self.page_size = store, store.page_size
        self.queries = self.keys = self.values = None

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor) -> None:
        self.keys, self.values = k.float(), v.float()
        self.store.write(k, v, slot_mapping, positions)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.queries = q.float()
        return self.store.attend(q, meta, scale)


def turned_pairs(kind: str, partial_pairs: int | None, head_dim: int) -> int:
    """The rotate-half pairs per KV head that ``--kv-key-offset kind`` turns: fixed 0, turned all D/2, partial
    ``--kv-key-turned-pairs`` (None: DEFAULT_KV_KEY_TURNED_PAIRS, at most D/2)."""
    if partial_pairs is None:
        partial_pairs = min(DEFAULT_KV_KEY_TURNED_PAIRS, head_dim // 2)
    if kind == "partial" and not 1 <= partial_pairs <= head_dim // 2:
        raise ValueError(f"--kv-key-turned-pairs must be in 1 .. {head_dim // 2} (head_dim / 2 of this model) with "
                         f"--kv-key-offset partial, got {partial_pairs}; use fixed for none, turned for all")
    return {"turned": head_dim // 2, "partial": partial_pairs}.get(kind, 0)  # fixed, none: 0


def constant_share(inv_freq: torch.Tensor, n: int) -> torch.Tensor:
    """|mean over p = 1 .. n of e^(i p theta_f)|^2 per pair [D/2]: the share of a direction turning with RoPE
    that a constant captures over n positions (1 for a pair that does not turn, ~0 for one that turns fast)."""
    angle = torch.arange(1, n + 1, dtype=torch.float64)[:, None] * inv_freq.double().cpu()[None]
    return (angle.cos().mean(0) ** 2 + angle.sin().mean(0) ** 2).to(inv_freq.device)


def turned_pair_gains(written: torch.Tensor, turned_back: torch.Tensor, inv_freq: torch.Tensor, keys: int,
                      context: int | None = None) -> torch.Tensor:
    """How much turning each rotate-half pair removes over a constant, [kv_heads, D/2], from the mean written keys
    c and the mean keys turned back to position 0 m (both [kv_heads, D]) over ``keys`` positions 1 .. keys.

    Without ``context``: |m_f|^2 - |c_f|^2, as measured on the calibration keys. With it: the same scaled
    to ``context`` positions, |m_f|^2 (1 - s_context) - |c_f|^2 (1 - s_keys), s = constant_share: a pair too
    slow to turn within the calibration text (m ~ c, no measured gain) still turns over a longer context,
    where a constant fitted to the short text misses its direction."""
    m2 = turned_back.pow(2).unflatten(-1, (2, -1)).sum(-2)
    c2 = written.pow(2).unflatten(-1, (2, -1)).sum(-2)
    if context is None:
        return m2 - c2
    return m2 * (1 - constant_share(inv_freq, context)) - c2 * (1 - constant_share(inv_freq, keys))


def partial_offset(written: torch.Tensor, turned_back: torch.Tensor, sink: torch.Tensor, inv_freq: torch.Tensor,
                   turned_pairs: int, keys: int, context: int | None = None) -> KeyOffset:
    """The offset turning the ``turned_pairs`` pairs of each KV head that gain most, constant on the rest."""
    half = written.shape[-1] // 2
    if not 0 <= turned_pairs <= half:
        raise ValueError(f"turned pairs must be in 0..{half} (head_dim / 2), got {turned_pairs}")
    if turned_pairs == 0:
        return KeyOffset.fixed(written, inv_freq)
    gains = turned_pair_gains(written, turned_back, inv_freq, keys, context)
    pairs = gains.topk(turned_pairs, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    turn = pair_mask(pairs, written.shape[-1])
    return KeyOffset(torch.where(turn, 0.0, written), torch.where(turn, turned_back, 0.0), sink, inv_freq, pairs)


@torch.inference_mode()
def record_attention(model, token_ids: list[int], num_layers: int, num_kv_heads: int, head_dim: int,
                     device: torch.device, dtype: torch.dtype) -> list[_Recorder]:
    """One prefill of ``token_ids`` at positions 0..n-1 -> per layer the queries, keys and values it attended with."""
    n = len(token_ids)
    if n <= SKIPPED_TOKENS:
        raise ValueError(f"KV calibration needs more than {SKIPPED_TOKENS} tokens, got {n}")
    pages = -(-n // CALIBRATION_PAGE_SIZE)
    recorders = [_Recorder(DenseKVStore(pages, CALIBRATION_PAGE_SIZE, num_kv_heads, head_dim, dtype, device))
                 for _ in range(num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        block_tables=torch.arange(pages, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens_cpu=[n], query_lens_cpu=[n],
    )  # fmt: skip
    model.forward(torch.tensor(token_ids, device=device), torch.arange(n, device=device), recorders, meta)
    return recorders


def offsets_of_keys(keys: torch.Tensor, inv_freq: torch.Tensor, turned_pairs: int,
                    context: int | None = None) -> KeyOffset:
    """One layer's key offset from the keys [n, kv_heads, D] written at positions 0..n-1 (kinds: key_offsets)."""
    back = -torch.arange(SKIPPED_TOKENS, keys.shape[0], device=keys.device)
    rest = keys[SKIPPED_TOKENS:]
    return partial_offset(rest.mean(0), rope_turn(rest, back, inv_freq).mean(0), keys[0].clone(), inv_freq,
                          turned_pairs, keys.shape[0] - SKIPPED_TOKENS, context)


def key_offsets(model, token_ids: list[int], num_layers: int, num_kv_heads: int, head_dim: int,
                device: torch.device, dtype: torch.dtype, turned_pairs: int,
                context: int | None = None) -> list[KeyOffset]:
    """One prefill of ``token_ids`` at positions 0..n-1 -> per layer the key offset that turns ``turned_pairs``
    rotate-half pairs per KV head (0: fixed, head_dim / 2: all), from all tokens but the first; the pairs
    chosen for ``context`` positions (turned_pair_gains)."""
    recorders = record_attention(model, token_ids, num_layers, num_kv_heads, head_dim, device, dtype)
    inv_freq = model.rope_inv_freq().to(device, torch.float32)
    return [offsets_of_keys(r.keys, inv_freq, turned_pairs, context) for r in recorders]


def balance_scales(attention, recorded: _Recorder, offsets: torch.Tensor | float,
                   exponents: tuple[float, float] = (KEY_EXPONENT, VALUE_EXPONENT)) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V channel scales (runtime/kv_balance.py at ``exponents``) from what the unbalanced
    ``attention`` ``recorded``, with ``offsets`` o(p) [n, kv_heads, D] (or 0) subtracted from its keys."""
    rest = slice(SKIPPED_TOKENS, None)  # the sink is unlike the other tokens, as for the offsets
    residual = (recorded.keys - offsets)[rest]
    q = recorded.queries.unflatten(1, (recorded.keys.shape[1], -1))[rest]  # [n, kv_heads, group, D]
    key_scale = key_scales(q.pow(2).mean((0, 2)), residual.pow(2).mean(0), attention.key_scale_per_head, exponents[0])
    value_scale = value_scales(attention.value_output_energy(), recorded.values[rest].pow(2).mean(0), exponents[1])
    return key_scale, value_scale


def balance_label(model) -> str:
    """"on" if the model has a K / V channel balance folded in (every layer or none), else "off"."""
    folded = hasattr(model, "attentions") and model.attentions()[0].key_scale is not None
    return "on" if folded else "off"


def calibrate_turbo_kv(model, tokenizer, stores: list, num_kv_heads: int, head_dim: int, device: torch.device,
                       dtype: torch.dtype, max_tokens: int, turned_pairs: int | None, balance: bool) -> None:
    """Measure on CALIBRATION_TEXT (at most ``max_tokens`` of it, the engine's max_model_len), before anything is
    written or captured: if ``balance``, fold the K / V channel balance into the model (kv_balance.py; a model without
    ``attentions()`` is left as it is) and give each turbo K store its layer's key offset
    (TurboKVStore.set_key_offset; ``turned_pairs`` None for none), a partial one turning the pairs that gain
    most over ``max_tokens`` positions. Both come from the model as loaded: a balance folded by an earlier
    engine over the same model is taken out first (also for a dense cache, which then runs no prefill). The fold
    is in the shared weights, so engines over one loaded model must run one at a time (the server builds one)."""
    attentions = model.attentions() if hasattr(model, "attentions") else []
    for attention in attentions:
        attention.set_kv_balance(None, None)
    balanced = attentions if balance else []
    if not balanced and turned_pairs is None:
        return  # a dense cache, or a turbo one with neither
    token_ids = tokenizer.encode(CALIBRATION_TEXT)[:max_tokens]
    recorders = record_attention(model, token_ids, len(stores), num_kv_heads, head_dim, device, dtype)
    inv_freq = model.rope_inv_freq().to(device, torch.float32)
    keys = [r.keys for r in recorders]
    offsets = None
    if turned_pairs is not None:
        offsets = [offsets_of_keys(k, inv_freq, turned_pairs, max_tokens) for k in keys]
    for layer, attention in enumerate(balanced):
        positions = torch.arange(keys[layer].shape[0], device=device)
        o = 0.0 if offsets is None else key_offset_at(offsets[layer], positions)
        key_scale, value_scale = balance_scales(attention, recorders[layer], o)
        attention.set_kv_balance(key_scale, value_scale)
        keys[layer] = keys[layer] * key_scale  # what the balanced layer writes
    if balanced:
        scales = torch.stack([s for a in balanced for s in (a.key_scale, a.value_scale)])
        log.info("turbo KV channel balance folded into the attention weights: K and V scales %.3g .. %.3g",
                 scales.min(), scales.max())
    if turned_pairs is None:
        return
    if balanced:  # the offsets of the keys the balanced model writes
        offsets = [offsets_of_keys(k, inv_freq, turned_pairs, max_tokens) for k in keys]
    for store, offset in zip(stores, offsets):
        store.set_key_offset(offset)
    norms = torch.stack([(o.const + o.mean).norm(dim=-1) for o in offsets])  # [layers, kv_heads]
    log.info(
        "turbo K offsets (%d of %d rotate-half pairs turned by RoPE%s): from %d calibration tokens; "
        "|offset| per layer and KV head min %.3g, mean %.3g, max %.3g", turned_pairs, head_dim // 2,
        ", the sink's key at position 0" if turned_pairs else "", len(token_ids) - SKIPPED_TOKENS,
        norms.min().item(), norms.mean().item(), norms.max().item(),
    )  # fmt: skip
