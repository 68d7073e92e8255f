"""Key offsets for turbo K caches (server/kernels/turbo/key_offset.py), measured once at start-up.

A turbo K store quantizes k - o(p). Both kinds of offset come from one forward pass over
CALIBRATION_TEXT with a dense cache in the model's own dtype, leaving out the first token, the
attention sink, whose key is unlike the others:
  * fixed (``--kv-key-offset fixed``, the default): o(p) = the mean of the keys as written, for
    every p. It shifts every score of a query row by the same <q, o>, which softmax ignores, so
    the fused decode kernel does no extra work;
  * turned: o(p) = RoPE(p) mean for p >= 1, with mean the keys turned back to position 0
    (RoPE(-p) k undoes the model's rotation) and averaged, and o(0) = the sink's own key. The
    keys' shared direction is fixed before RoPE, so this removes much more of it (perplexity in
    docs/BENCHMARKS.md "Quality"), but attention has to add <q, o(p)> per key (decode attention
    about 36 % slower on the H200).
Fixed per model (never per batch or sequence, so batch invariance holds), deterministic, and one
short prefill at start-up. A model without RoPE (``rope_inv_freq`` all zero) turns nothing.
"""

from __future__ import annotations

import logging

import torch

from server.kernels.paged_kv import AttentionMetadata, DenseKVStore
from server.kernels.turbo.key_offset import KeyOffset, rope_turn

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


class _KeyRecorder:
    """A dense store that keeps the last keys it was given (one layer)."""

    def __init__(self, store: DenseKVStore):
        self.store, self.page_size, self.keys = store, store.page_size, None

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor) -> None:
        self.keys = k.float()
        self.store.write(k, v, slot_mapping, positions)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self.store.attend(q, meta, scale)


@torch.inference_mode()
def key_offsets(model, token_ids: list[int], num_layers: int, num_kv_heads: int, head_dim: int,
                device: torch.device, dtype: torch.dtype, turned: bool = True) -> list[KeyOffset]:
    """One prefill of ``token_ids`` at positions 0..n-1 -> per layer the key offset over all tokens but the
    first (float32 [kv_heads, D]): turned, the mean of the keys turned back to position 0 and the first token's
    key as the sink; else the mean of the keys as written, at every position."""
    n = len(token_ids)
    if n <= SKIPPED_TOKENS:
        raise ValueError(f"key calibration needs more than {SKIPPED_TOKENS} tokens, got {n}")
    pages = -(-n // CALIBRATION_PAGE_SIZE)
    recorders = [_KeyRecorder(DenseKVStore(pages, CALIBRATION_PAGE_SIZE, num_kv_heads, head_dim, dtype, device))
                 for _ in range(num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        block_tables=torch.arange(pages, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens_cpu=[n], query_lens_cpu=[n],
    )  # fmt: skip
    positions = torch.arange(n, device=device)
    model.forward(torch.tensor(token_ids, device=device), positions, recorders, meta)
    inv_freq = model.rope_inv_freq().to(device, torch.float32)
    if not turned:
        means = [r.keys[SKIPPED_TOKENS:].mean(0) for r in recorders]
        return [KeyOffset(m, m.clone(), torch.zeros_like(inv_freq)) for m in means]
    back = -positions[SKIPPED_TOKENS:]
    return [KeyOffset(rope_turn(r.keys[SKIPPED_TOKENS:], back, inv_freq).mean(0), r.keys[0].clone(), inv_freq)
            for r in recorders]


def calibrate_key_offsets(model, tokenizer, stores: list, num_kv_heads: int, head_dim: int,
                          device: torch.device, dtype: torch.dtype, max_tokens: int, turned: bool) -> None:
    """Measure the key offsets on CALIBRATION_TEXT (at most ``max_tokens`` of it) and give each turbo
    store its layer's (TurboKVStore.set_key_offset). Call before anything is written or captured."""
    token_ids = tokenizer.encode(CALIBRATION_TEXT)[:max_tokens]
    offsets = key_offsets(model, token_ids, len(stores), num_kv_heads, head_dim, device, dtype, turned)
    for store, offset in zip(stores, offsets):
        store.set_key_offset(offset)
    norms = torch.stack([o.mean.norm(dim=-1) for o in offsets])  # [layers, kv_heads]
    log.info(
        "turbo K offsets (%s): mean key per layer and KV head over %d calibration tokens; |mean| min %.3g, "
        "mean %.3g, max %.3g", "turned by RoPE, and the sink's key at position 0" if turned else "fixed",
        len(token_ids) - SKIPPED_TOKENS, norms.min().item(), norms.mean().item(), norms.max().item(),
    )  # fmt: skip
