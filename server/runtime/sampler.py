"""Turn logits into tokens, with vLLM's semantics.

Order (vLLM v1): penalties on the raw logits -> greedy argmax, or temperature -> min-p ->
top-k -> top-p -> an exponential race. Logprobs are always taken from the raw model
logits, as OpenAI and vLLM report them.

The race picks argmax(p_i / E_i) with E_i ~ Exp(1), which is token i with probability
p_i. Its noise is counter-based: E_i is a hash of (seed, step, i), where step is how many
tokens the sequence has generated. A row's draw therefore never depends on which other
rows share the batch, nor on a preemption and recompute in between; no generator state
is carried around, and a whole batch draws its noise in a few kernels. (An inverse-CDF
draw would be cheaper, but a cumulative sum over the vocabulary turns bf16 logit noise
between batch shapes into different tokens; the race only compares tokens pairwise.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.kernels.backend import use_triton
from server.kernels.host_copy import to_device
from server.runtime.sequence import Sequence, TokenLogprob

# float32 limits of the sampling math (temperature's are SamplingParams.greedy's): a top_p below the smallest
# normal rounds to 0 and drops every token, so it is raised to that, which keeps only the best one; a
# repetition penalty past 1e20 either way overflows the logits (inf, or 0 x inf = NaN), while at 1e20 a seen
# token already wins (or loses) against any unseen one, so clamping there changes nothing else.
FLOAT32_TINY = 2.0**-126
REPETITION_LIMIT = 1e20

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # SplitMix64's finalizer: nearby inputs (seed, seed + 1; step, step + 1) give unrelated outputs.
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Integer hash of uint32 values held in int64. Odd multipliers below 2**31 keep every
    product below 2**63, so nothing overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _U32
    return x ^ (x >> 16)


def row_key(seed: int, step: int) -> int:
    """32 bits naming one (seed, step) draw."""
    return _splitmix64((_splitmix64(seed & _U64) + step) & _U64) & _U32


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] Exp(1) draws; entry (b, i) is a pure function of (keys[b], i)."""
    cols = _mix32(torch.arange(vocab_size, device=keys.device, dtype=torch.int64))
    bits = _mix32(keys[:, None] ^ cols[None, :]) >> 8  # 24 bits: exact in float32
    return -torch.log((bits.float() + 0.5) * (1.0 / (1 << 24)))


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """vLLM: repetition over prompt and output tokens, frequency and presence over output only."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0).to(logits.dtype)


def mask_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the k best tokens (ties with the k-th kept), then the smallest best-first set
    whose probability reaches top_p (a token stays while the mass before it is < top_p)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (top_k - 1).clamp(0, logits.shape[1] - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, on the logits' device. An all-greedy batch
    without penalties (the common serving case) builds no tensors at all."""

    all_greedy: bool
    use_min_p: bool = False
    use_top_k_top_p: bool = False
    greedy: torch.Tensor | None = None  # [B] bool
    temperature: torch.Tensor | None = None  # [B]; 1 for greedy rows
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None  # [B] int64; vocab size when off
    keys: torch.Tensor | None = None  # [B] int64: row_key(seed, tokens generated so far)
    penalties: tuple[torch.Tensor, ...] | None = None  # apply_penalties' arguments after logits
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) masked out: min_tokens not reached

    @classmethod
    def from_sequences(
        cls, seqs: list[Sequence], vocab_size: int, device: torch.device, ahead: list[bool] | None = None
    ) -> SamplingTensors:
        """``ahead[i]``: the step samples sequence i's token after the one still on the device, so
        its noise is keyed one generated token further than the host has seen."""
        ahead = ahead or [False] * len(seqs)
        params = [s.params for s in seqs]
        penalties = _penalty_tensors(seqs, vocab_size, device) if any(p.penalized for p in params) else None
        banned = _banned_tokens(seqs, vocab_size, device, ahead) if any(p.min_tokens for p in params) else None
        if all(p.greedy for p in params):
            return cls(all_greedy=True, penalties=penalties, banned=banned)
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        # One host-to-device copy instead of five.
        columns = [
            [float(p.greedy), 1.0 if p.greedy else p.temperature, max(p.top_p, FLOAT32_TINY), p.min_p, k]
            for p, k in zip(params, top_k)
        ]
        floats = to_device(torch.tensor(columns, dtype=torch.float32), device)  # top_k < 2**24: exact in float32
        keys = [row_key(s.seed, s.num_generated_tokens + a) for s, a in zip(seqs, ahead)]
        return cls(
            all_greedy=False,
            use_min_p=any(p.min_p > 0 and not p.greedy for p in params),
            use_top_k_top_p=any((k < vocab_size or p.top_p < 1.0) and not p.greedy for k, p in zip(top_k, params)),
            greedy=floats[:, 0] > 0,
            temperature=floats[:, 1],
            top_p=floats[:, 2],
            min_p=floats[:, 3],
            top_k=floats[:, 4].long(),
            keys=to_device(torch.tensor(keys, dtype=torch.int64), device),
            penalties=penalties,
            banned=banned,
        )


def _banned_tokens(seqs: list[Sequence], vocab_size: int, device: torch.device,
                   ahead: list[bool]) -> tuple[torch.Tensor, ...] | None:
    """(rows, token ids) of the stop ids of every sequence still short of its min_tokens (vLLM's min_tokens:
    end-of-sequence and stop_token_ids cannot be sampled before it), or None when no sequence is. Ids outside
    the vocabulary (a client's stop_token_ids may hold any integer) cannot be sampled anyway."""
    short = [row for row, (s, a) in enumerate(zip(seqs, ahead)) if s.num_generated_tokens + a < s.params.min_tokens]
    pairs = [(row, token) for row in short for token in sorted(seqs[row].stop_ids) if 0 <= token < vocab_size]
    if not pairs:
        return None
    rows, tokens = to_device(torch.tensor(pairs, dtype=torch.int64).T.contiguous(), device)
    return rows, tokens


def _penalty_tensors(seqs: list[Sequence], vocab_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    prompt_mask = torch.zeros(len(seqs), vocab_size, dtype=torch.bool)
    output_counts = torch.zeros(len(seqs), vocab_size, dtype=torch.float32)
    for row, seq in enumerate(seqs):
        prompt_mask[row, seq.prompt_token_ids] = True
        output_counts[row].index_add_(
            0, torch.tensor(seq.output_token_ids, dtype=torch.int64), torch.ones(seq.num_generated_tokens)
        )
    params = [s.params for s in seqs]
    factors = torch.tensor(
        [[min(max(p.repetition_penalty, 1 / REPETITION_LIMIT), REPETITION_LIMIT), p.frequency_penalty,
          p.presence_penalty] for p in params], dtype=torch.float32
    )
    factors = to_device(factors, device)
    return to_device(prompt_mask, device), to_device(output_counts, device), factors[:, 0], factors[:, 1], factors[:, 2]


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1); where Triton runs, the two-pass kernel of server/kernels/argmax.py (imported only there:
    CPU installs may have no Triton)."""
    if use_triton(x):
        from server.kernels.argmax import argmax_rows

        return argmax_rows(x)
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[B, V] float32 logits -> [B] int64 token ids."""
    if st.penalties is not None:
        logits = apply_penalties(logits, *st.penalties)
    if st.banned is not None:
        logits = logits.index_put(st.banned, torch.tensor(float("-inf"), device=logits.device))
    greedy = _argmax(logits)
    if st.all_greedy:
        return greedy
    logits = logits / st.temperature[:, None]
    if st.use_min_p:
        logits = mask_min_p(logits, st.min_p)
    if st.use_top_k_top_p:
        logits = mask_top_k_top_p(logits, st.top_k, st.top_p)
    probs = torch.softmax(logits, dim=-1)
    sampled = _argmax(probs / exponential_noise(st.keys, logits.shape[1]))
    return torch.where(st.greedy, greedy, sampled)


def token_logprobs(
    raw_logits: torch.Tensor, tokens: torch.Tensor, num_top: list[int | None]
) -> list[TokenLogprob | None]:
    """Logprob of each chosen token and its row's ``num_top`` best alternatives (None: not asked)."""
    wanted = [i for i, k in enumerate(num_top) if k is not None]
    out: list[TokenLogprob | None] = [None] * len(num_top)
    if not wanted:
        return out
    rows = to_device(torch.tensor(wanted), raw_logits.device)
    logprobs = torch.log_softmax(raw_logits[rows].float(), dim=-1)
    chosen = logprobs.gather(1, tokens[rows][:, None]).squeeze(1).tolist()
    token_ids = tokens.tolist()
    k_max = max(num_top[i] for i in wanted)
    top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (logprobs[:, :0], logprobs[:, :0])
    top_values, top_ids = top_values.tolist(), top_ids.long().tolist()
    for j, i in enumerate(wanted):
        k = num_top[i]
        top = list(zip(top_ids[j][:k], top_values[j][:k]))
        out[i] = TokenLogprob(token_id=token_ids[i], logprob=chosen[j], top=top)
    return out
