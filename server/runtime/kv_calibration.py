"""Per-head transforms for turbo K/V caches, measured once at start-up (TurboKVStore.set_transform).

The store quantizes (k - m) * s and v * t and attention undoes both exactly (store.py says how).
All three are fixed per model (never per batch or sequence, so batch invariance holds),
deterministic, and come from short prefills over CALIBRATION_TEXT with a dense cache in the
model's own dtype. The first token is left out everywhere: it is the attention sink, whose key
is unlike the others.

  * m, the mean post-RoPE key of each (layer, KV head). Real keys share a large direction per
    head (on SmolLM2-135M the mean key is about 80% of a key's length) and the quantizer's error
    is relative to the whole vector, so subtracting it leaves only what tells tokens apart.
  * s, per channel. The rotation spreads the quantizer's error evenly over the channels of what
    is stored, with a size that grows with sum_i s_i^2 a_i (a_i = E (k_i - m_i)^2), and a score
    q . k picks up channel i's error times q_i / s_i. The mean squared score error
    (sum_i s_i^2 a_i) (sum_i b_i / s_i^2), b_i = E q_i^2 over the head's queries, is smallest
    (Cauchy-Schwarz) for s_i^4 proportional to b_i / a_i.
  * t, per channel, by the same argument for values: the output error in channel i is the
    stored error over t_i, with a size growing with sum_i t_i^2 c_i (c_i = E v_i^2), so
    (sum_i t_i^2 c_i) (sum_i 1 / t_i^2) is smallest for t_i^4 proportional to 1 / c_i.
s and t are rounded to powers of two (exact undoing in fp16/bf16; no measurable loss,
docs/BENCHMARKS.md "Quality") with geometric mean 1 per head (norms keep their fp16 range).
RoPE turns keys with their position, so a_i and b_i measured at positions 0..n only would
overweight the slowly turning channels; they are averaged over the same text run at
POSITION_SHIFTS (RoPE is relative: the model computes the same thing, keys turned further).

Measured (docs/BENCHMARKS.md "Quality", SmolLM2-135M, ctx 2048, 4 windows, vs bf16): m alone
takes turbo3 from +24% to +15.3% and turbo4 from +4.5% to +3.8%; s and t on top move turbo3
to +15.0..15.5% and turbo4 to +3.3..3.9% depending on which of them is on, i.e. within the
noise, while attention pays two extra elementwise launches per layer for them. So engines
apply m only; ``equalize=True`` applies s and t as well (for models where they may pay).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from server.kernels.paged_kv import AttentionMetadata, DenseKVStore

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
# Where a's and b's positions are taken (first positions of each run); runs that would pass the
# model's served length are left out. 2048 tokens: the context the quality table measures.
POSITION_SHIFTS = (0, 512, 1024, 1536)
MAX_SCALE_EXPONENT = 8  # s, t within 2^-8 .. 2^8 whatever the statistics (a dead channel has a = 0)


class _Recorder:
    """A dense store that keeps the last keys, values and queries it was given (one layer), float32."""

    def __init__(self, store: DenseKVStore):
        self.store, self.page_size = store, store.page_size
        self.keys = self.values = self.queries = None

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.keys, self.values = k.float(), v.float()
        self.store.write(k, v, slot_mapping)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.queries = q.float()
        return self.store.attend(q, meta, scale)


@dataclass
class KVStatistics:
    """One layer's calibration statistics, float32 [kv_heads, D] each, over tokens 1..n-1."""

    key_mean: torch.Tensor  # m, at positions 0..n-1
    key_spread: torch.Tensor  # a = E (k - m)^2, over every run of POSITION_SHIFTS
    query_power: torch.Tensor  # b = E q^2 over the query heads that read this KV head, every run
    value_power: torch.Tensor  # c = E v^2


@torch.inference_mode()
def _prefill(model, token_ids: list[int], first_position: int, num_layers: int, num_kv_heads: int,
             head_dim: int, device: torch.device, dtype: torch.dtype) -> list[_Recorder]:
    n = len(token_ids)
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
    positions = torch.arange(first_position, first_position + n, device=device)
    model.forward(torch.tensor(token_ids, device=device), positions, recorders, meta)
    return recorders


def kv_statistics(model, token_ids: list[int], num_layers: int, num_kv_heads: int, head_dim: int,
                  device: torch.device, dtype: torch.dtype, max_positions: int) -> list[KVStatistics]:
    """Prefills of ``token_ids`` starting at each POSITION_SHIFTS entry that keeps them under
    ``max_positions`` (0 always) -> per layer the statistics the transform is made from."""
    n = len(token_ids)
    if n <= SKIPPED_TOKENS:
        raise ValueError(f"KV calibration needs more than {SKIPPED_TOKENS} tokens, got {n}")
    shifts = [p for p in POSITION_SHIFTS if p == 0 or p + n <= max_positions]
    runs = [_prefill(model, token_ids, p, num_layers, num_kv_heads, head_dim, device, dtype) for p in shifts]
    stats = []
    for layer in range(num_layers):
        first = runs[0][layer]
        m = first.keys[SKIPPED_TOKENS:].mean(0)
        keys = torch.cat([run[layer].keys[SKIPPED_TOKENS:] for run in runs])
        queries = torch.cat([run[layer].queries[SKIPPED_TOKENS:] for run in runs])
        by_kv_head = queries.reshape(queries.shape[0], num_kv_heads, -1, head_dim)  # GQA: head h reads h // group
        stats.append(KVStatistics(m, (keys - m).pow(2).mean(0), by_kv_head.pow(2).mean((0, 2)),
                                  first.values[SKIPPED_TOKENS:].pow(2).mean(0)))
    return stats


def power_of_two_scales(log2_scale: torch.Tensor) -> torch.Tensor:
    """2^round(e) per channel after centring e per head (geometric mean 1), within MAX_SCALE_EXPONENT."""
    centred = log2_scale - log2_scale.mean(-1, keepdim=True)
    return torch.exp2(centred.round().clamp(-MAX_SCALE_EXPONENT, MAX_SCALE_EXPONENT))


def equalizing_transform(stats: KVStatistics) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, s, t) from one layer's statistics: s^4 ~ b / a, t^4 ~ 1 / c (the module docstring derives them)."""
    tiny = torch.finfo(torch.float32).tiny  # a dead channel (a, b or c = 0) gets an extreme, finite exponent
    log_k = 0.25 * (torch.log2(stats.query_power + tiny) - torch.log2(stats.key_spread + tiny))
    log_v = -0.25 * torch.log2(stats.value_power + tiny)
    return stats.key_mean, power_of_two_scales(log_k), power_of_two_scales(log_v)


def calibrate_turbo_stores(model, tokenizer, stores: list, num_kv_heads: int, head_dim: int,
                           device: torch.device, dtype: torch.dtype, max_tokens: int, equalize: bool = False) -> None:
    """Measure the statistics on CALIBRATION_TEXT (at most ``max_tokens`` of it, runs within ``max_tokens``
    positions) and give each turbo store its layer's offset m, and with ``equalize`` its scales s and t too
    (off by default: see "Measured" above). Call before anything is written."""
    token_ids = tokenizer.encode(CALIBRATION_TEXT)[:max_tokens]
    positions = max_tokens if equalize else len(token_ids)  # m needs only the unshifted run
    stats = kv_statistics(model, token_ids, len(stores), num_kv_heads, head_dim, device, dtype, positions)
    transforms = [equalizing_transform(layer) for layer in stats]
    for store, (m, s, t) in zip(stores, transforms):
        store.set_transform(m, *((s, t) if equalize else (None, None)))
    norms = torch.stack([m.norm(dim=-1) for m, _, _ in transforms])  # [layers, kv_heads]
    k_exp, v_exp = (torch.stack([x[i] for x in transforms]).log2().abs().max().item() for i in (1, 2))
    log.info(
        "turbo K/V transforms over %d calibration tokens: |m| min %.3g, mean %.3g, max %.3g; %s",
        len(token_ids) - SKIPPED_TOKENS, norms.min().item(), norms.mean().item(), norms.max().item(),
        f"K scales within 2^+-{k_exp:.0f}, V scales within 2^+-{v_exp:.0f}" if equalize else "no K/V scales",
    )  # fmt: skip
