"""Turn logits into tokens, with vLLM's semantics.

Order (vLLM v1): penalties on the raw logits -> greedy argmax, or temperature -> min-p ->
top-k -> top-p -> a seeded exponential race. Logprobs are always taken from the raw
model logits, as OpenAI and vLLM report them.

Seeded noise is counter-based: the uniform for (seed, step, token) is a hash of those
three numbers, where step is how many tokens the sequence has generated. A row's noise
therefore never depends on which other rows share the batch, nor on a preemption and
recompute in between, and no generator state has to be carried around.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.runtime.sequence import Sequence, TokenLogprob

_U32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for uint32 values held in int64, without signed overflow."""
    low = (x & 0xFFFF) * c
    high = (((x >> 16) * c) & 0xFFFF) << 16
    return (low + high) & _U32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # "lowbias32" integer hash (C. Wellons): full avalanche on 32-bit inputs.
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seeded_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1), a pure function of (seed, step, token id)."""
    row = _mix32(_mix32(_mix32(seeds & _U32) ^ ((seeds >> 32) & _U32)) ^ (steps & _U32))
    col = _mix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) ^ 0x9E3779B9)
    bits = _mix32(row[:, None] ^ col[None, :]) >> 8  # 24 bits: exact in float32
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


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
    """Per-row sampling parameters of one step, on the logits' device."""

    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor
    top_k: torch.Tensor  # [B] int64; vocab size when off
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: tokens generated so far
    all_greedy: bool
    use_min_p: bool
    use_top_k_top_p: bool
    penalties: tuple[torch.Tensor, ...] | None  # apply_penalties' arguments after logits

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingTensors:
        params = [s.params for s in seqs]

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        penalized = any(
            p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params
        )
        return cls(
            greedy=column([p.greedy for p in params], torch.bool),
            temperature=column([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32),
            top_k=column(top_k, torch.int64),
            top_p=column([p.top_p for p in params], torch.float32),
            min_p=column([p.min_p for p in params], torch.float32),
            seeds=column([s.seed for s in seqs], torch.int64),
            steps=column([s.num_generated_tokens for s in seqs], torch.int64),
            all_greedy=all(p.greedy for p in params),
            use_min_p=any(p.min_p > 0 and not p.greedy for p in params),
            use_top_k_top_p=any((k < vocab_size or p.top_p < 1.0) and not p.greedy for k, p in zip(top_k, params)),
            penalties=_penalty_tensors(seqs, vocab_size, device) if penalized else None,
        )


def _penalty_tensors(seqs: list[Sequence], vocab_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    prompt_mask = torch.zeros(len(seqs), vocab_size, dtype=torch.bool)
    output_counts = torch.zeros(len(seqs), vocab_size, dtype=torch.float32)
    for row, seq in enumerate(seqs):
        prompt_mask[row, seq.prompt_token_ids] = True
        output_counts[row].index_add_(0, torch.tensor(seq.output_token_ids, dtype=torch.int64), torch.ones(seq.num_generated_tokens))
    params = [s.params for s in seqs]
    return (
        prompt_mask.to(device),
        output_counts.to(device),
        torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device),
    )


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[B, V] float32 logits -> [B] int64 token ids."""
    if st.penalties is not None:
        logits = apply_penalties(logits, *st.penalties)
    greedy = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy
    logits = logits / st.temperature[:, None]
    if st.use_min_p:
        logits = mask_min_p(logits, st.min_p)
    if st.use_top_k_top_p:
        logits = mask_top_k_top_p(logits, st.top_k, st.top_p)
    probs = torch.softmax(logits, dim=-1)
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with probability p_i.
    exponentials = -torch.log(seeded_uniform(st.seeds, st.steps, logits.shape[1]))
    sampled = (probs / exponentials).argmax(dim=-1)
    return torch.where(st.greedy, greedy, sampled)


def token_logprobs(raw_logits: torch.Tensor, tokens: torch.Tensor, num_top: list[int | None]) -> list[TokenLogprob | None]:
    """Logprob of each chosen token and its row's ``num_top`` best alternatives (None: not asked)."""
    wanted = [i for i, k in enumerate(num_top) if k is not None]
    out: list[TokenLogprob | None] = [None] * len(num_top)
    if not wanted:
        return out
    rows = torch.tensor(wanted, device=raw_logits.device)
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
