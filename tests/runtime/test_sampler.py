"""Each sampling knob against a direct float64 computation (sampler.py states the semantics)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server.runtime.sampler import (
    SamplingTensors,
    apply_penalties,
    exponential_noise,
    mask_min_p,
    mask_top_k_top_p,
    row_key,
    sample,
    token_logprobs,
)
from server.runtime.sequence import SamplingParams, Sequence

V = 37  # odd vocabulary


def softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def kept_by_top_k_top_p(row: np.ndarray, k: int, p: float) -> set[int]:
    order = np.argsort(-row, kind="stable")[:k]
    probs = softmax64(row[order])
    mass_before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
    return {int(t) for t, m in zip(order, mass_before) if p >= 1.0 or m < p}


@pytest.mark.parametrize("k", [1, 2, 5, 36, V])
@pytest.mark.parametrize("p", [0.01, 0.5, 0.9, 1.0])
def test_top_k_top_p_mask_matches_float64(k, p):
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(k * 100 + int(p * 100))) * 3
    masked = mask_top_k_top_p(logits, torch.full((6,), k), torch.full((6,), p))
    for row in range(6):
        kept = set(torch.isfinite(masked[row]).nonzero().flatten().tolist())
        assert kept == kept_by_top_k_top_p(logits[row].double().numpy(), k, p), f"row {row}"
        assert torch.equal(masked[row][list(kept)], logits[row][list(kept)]), "kept logits must be unchanged"


def test_top_k_keeps_ties_with_the_kth_token():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.5]])
    masked = mask_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(masked).tolist() == [[False, True, True, True, False]]


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_min_p_mask_matches_float64(min_p):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(7)) * 2
    masked = mask_min_p(logits, torch.full((4,), min_p))
    for row in range(4):
        probs = softmax64(logits[row].double().numpy())
        expected = {int(i) for i in np.nonzero(probs >= min_p * probs.max())[0]}
        assert set(torch.isfinite(masked[row]).nonzero().flatten().tolist()) == expected


def test_penalties_on_a_hand_computed_example():
    # prompt {0}; output [1, 3, 3]; repetition 2, frequency 0.5, presence 0.25 (vLLM rules):
    #   t0 seen in prompt, positive: 2 / 2 = 1
    #   t1 once in output, negative: -1 * 2 - 0.5 * 1 - 0.25 = -2.75
    #   t2 unseen: 0.5
    #   t3 twice in output: 3 / 2 - 0.5 * 2 - 0.25 = 0.25
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = apply_penalties(
        logits,
        prompt_mask=torch.tensor([[True, False, False, False]]),
        output_counts=torch.tensor([[0.0, 1.0, 0.0, 2.0]]),
        repetition=torch.tensor([2.0]),
        frequency=torch.tensor([0.5]),
        presence=torch.tensor([0.25]),
    )
    assert out.tolist() == [[1.0, -2.75, 0.5, 0.25]]


def sequences(params: list[SamplingParams], prompt=(1, 2), outputs=(), seeds=None) -> list[Sequence]:
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(f"r{i}", list(prompt), p, seed=(seeds or [i] * len(params))[i])
        for t in outputs:
            seq.append_token(t)
        seqs.append(seq)
    return seqs


def test_greedy_with_penalties_picks_argmax_of_penalized_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.9]])
    seqs = sequences([SamplingParams(temperature=0.0, repetition_penalty=2.0)], prompt=(0,), outputs=())
    assert sample(logits, SamplingTensors.from_sequences(seqs, 4, torch.device("cpu"))).tolist() == [3]
    plain = sequences([SamplingParams(temperature=0.0)], prompt=(0,))
    assert sample(logits, SamplingTensors.from_sequences(plain, 4, torch.device("cpu"))).tolist() == [0]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-40, seed=1),  # logits / T overflow float32: greedy below 1e-5
    SamplingParams(temperature=1.0, top_p=1e-300, seed=2),  # rounds to 0 in float32: keeps the best token
    SamplingParams(temperature=1.0, top_k=3, repetition_penalty=1e-40, seed=3),  # 1 / penalty overflows
    SamplingParams(temperature=1.0, top_k=3, repetition_penalty=1e40, seed=4),
])
def test_params_past_float32s_range_sample_the_best_token_not_nan(params):
    # The best logit (token 3) was neither in the prompt nor generated, so no penalty moves it; the others
    # were, and a huge penalty pushes them far below it (a tiny one far above: then the best seen one wins).
    logits = torch.tensor([[0.5, -1.0, 1.0, 2.0, -0.5]])
    seqs = sequences([params], prompt=(0, 1, 2, 4), outputs=())
    token = sample(logits.clone(), SamplingTensors.from_sequences(seqs, 5, torch.device("cpu"))).item()
    expected = 2 if params.repetition_penalty < 1 else 3
    assert token == expected, f"{params}: sampled {token}"


def test_exponential_noise_is_a_function_of_seed_step_and_token():
    keys = torch.tensor([row_key(5, 0), row_key(5, 1), row_key(6, 0), row_key(-3, 0), row_key(2**70, 0)])
    assert len(set(keys.tolist())) == 5, "different (seed, step) pairs must name different draws"
    noise = exponential_noise(keys, 4000)
    assert torch.equal(noise[0], exponential_noise(keys[:1], 4000)[0])
    # Exp(1): mean 1 and P(E > 1) = 1/e, within 4 standard errors of 20000 draws.
    draws = noise.flatten().double()
    assert abs(draws.mean().item() - 1.0) < 4 / 20000**0.5
    frac = (draws > 1).double().mean().item()
    assert abs(frac - np.exp(-1)) < 4 * (np.exp(-1) * (1 - np.exp(-1)) / 20000) ** 0.5
    # Neighbouring tokens and neighbouring steps are not correlated.
    for a, b in ((noise[0, :-1], noise[0, 1:]), (noise[0], noise[1])):
        assert abs(np.corrcoef(a.numpy(), b.numpy())[0, 1]) < 0.05


def test_seeded_sampling_follows_the_filtered_distribution():
    # One seed, 6000 consecutive steps: the empirical frequencies must match softmax(logits / T)
    # restricted by top-k. (Deterministic: the noise is seeded, so this cannot flake.)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    params = SamplingParams(temperature=0.8, top_k=4, seed=42)
    n = 6000
    seqs = sequences([params] * n, seeds=[42] * n)
    for step, seq in enumerate(seqs):
        seq.output_token_ids = [0] * step  # only the count matters: it is the step
    tokens = sample(logits.expand(n, -1).clone(), SamplingTensors.from_sequences(seqs, 6, torch.device("cpu")))
    probs = softmax64(np.where(np.isin(np.arange(6), [5, 0, 1, 2]), logits.double().numpy() / 0.8, -np.inf))
    counts = np.bincount(tokens.numpy(), minlength=6)
    assert counts[3] == counts[4] == 0, "top-k excluded tokens were sampled"
    kept = probs > 0
    chi2 = (((counts - n * probs) ** 2)[kept] / (n * probs)[kept]).sum()
    assert chi2 < 16.3, f"chi-square {chi2:.1f} (3 dof, p ~ 0.001 at 16.3): {counts} vs {n * probs}"


def test_a_seeded_row_samples_the_same_alone_or_in_any_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 50, generator=gen)
    params = [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9, seed=12),
        SamplingParams(temperature=1.5, min_p=0.1, seed=13),
        SamplingParams(temperature=1.0, top_k=3, seed=14),
    ]
    seqs = sequences(params, outputs=(4, 5), seeds=[11, 0, 12, 13, 14])
    cpu = torch.device("cpu")
    batched = sample(logits, SamplingTensors.from_sequences(seqs, 50, cpu)).tolist()
    alone = [sample(logits[i : i + 1], SamplingTensors.from_sequences([s], 50, cpu)).item() for i, s in enumerate(seqs)]
    assert batched == alone
    assert batched[1] == int(logits[1].argmax())


def test_logprobs_are_raw_log_softmax_with_best_first_alternatives():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5)) * 4
    tokens = torch.tensor([0, 5, 9])
    out = token_logprobs(logits, tokens, [3, None, 0])
    assert out[1] is None
    for row, k in ((0, 3), (2, 0)):
        exact = logits[row].double() - torch.logsumexp(logits[row].double(), 0)
        assert out[row].token_id == tokens[row].item()
        assert out[row].logprob == pytest.approx(exact[tokens[row]].item(), abs=1e-5)
        best = torch.argsort(exact, descending=True)[:k].tolist()
        assert [t for t, _ in out[row].top] == best
        assert [lp for _, lp in out[row].top] == pytest.approx(exact[best].tolist(), abs=1e-5)


def _seq(generated: int, params: SamplingParams, stop_ids) -> Sequence:
    seq = Sequence("r", [1, 2], params, seed=5)
    for t in range(generated):
        seq.append_token(t)
    seq.stop_ids = frozenset(stop_ids)
    return seq


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_the_stop_ids_until_reached(temperature):
    """Rows short of min_tokens never sample their stop ids (even the top logit); the others are untouched."""
    logits = torch.zeros(3, V)
    logits[:, 4] = 50.0  # the stop id is by far the likeliest token
    logits[:, 9] = 10.0
    params = SamplingParams(max_tokens=10, min_tokens=3, temperature=temperature, seed=1)
    seqs = [_seq(1, params, {4, 99}), _seq(3, params, {4}), _seq(2, params, {4})]  # 99: outside the vocabulary
    st = SamplingTensors.from_sequences(seqs, V, torch.device("cpu"))
    assert sample(logits, st).tolist() == [9, 4, 9]
    ahead = SamplingTensors.from_sequences(seqs, V, torch.device("cpu"), ahead=[False, False, True])
    assert sample(logits, ahead).tolist() == [9, 4, 4], "a token still in flight counts as generated"
    ahead = SamplingTensors.from_sequences(seqs, V, torch.device("cpu"), ahead=[True, True, False])
    assert sample(logits, ahead).tolist() == [9, 4, 9], "only the rows whose token is in flight"
    plain = [_seq(0, SamplingParams(max_tokens=10, temperature=temperature, seed=1), {4})]
    assert SamplingTensors.from_sequences(plain, V, torch.device("cpu")).banned is None
