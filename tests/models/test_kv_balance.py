"""K / V channel balance (server/runtime/kv_balance.py) folded into the attention weights: the model computes the
same function while its KV cache sees balanced channels."""

from __future__ import annotations

import pytest
import torch

from server.kernels.paged_kv import AttentionMetadata, DenseKVStore
from server.runtime.kv_balance import key_scales, value_scales
from tests.models.tiny_llama import tiny_llama

N = 37  # tokens: not a multiple of the page size


class Spy(DenseKVStore):
    """A dense store that keeps the keys and values written to it."""

    def write(self, k, v, slot_mapping, positions):
        self.k, self.v = k.clone(), v.clone()
        super().write(k, v, slot_mapping, positions)


def run(model, ids):
    """Logits [N, vocab] and each layer's written keys and values, one prefill in 16-token pages."""
    cfg = model.config
    spies = [Spy(-(-N // 16), 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu") for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.arange(N), torch.arange(-(-N // 16), dtype=torch.int32)[None],
                             torch.tensor([N], dtype=torch.int32), torch.tensor([0, N], dtype=torch.int32), [N], [N])
    with torch.no_grad():
        logits = model.compute_logits(model.forward(ids, torch.arange(N), spies, meta))
    return logits, [(s.k, s.v) for s in spies]


def random_scales(heads, head_dim, generator, shared=False):
    """Positive K scales equal on each rotate-half pair (and on all heads if ``shared``), and V scales."""
    k = torch.rand(1 if shared else heads, head_dim // 2, generator=generator).mul(3).add(0.25).repeat(1, 2)
    return k.expand(heads, head_dim).contiguous(), torch.rand(heads, head_dim, generator=generator).mul(3).add(0.25)


MODELS = {
    "llama GQA 2": dict(num_heads=4, num_kv_heads=2),
    "GQA 3 with q/k/v and o biases": dict(num_heads=6, num_kv_heads=2, attention_bias=True, attention_output_bias=True),
    "MHA": dict(num_heads=2, num_kv_heads=2),
    "qwen3 q/k norm, GQA 4": dict(num_heads=8, num_kv_heads=2, qk_norm=True, architecture="qwen3"),
}


@pytest.mark.parametrize("name", MODELS)
def test_a_folded_balance_keeps_the_logits_and_scales_what_the_cache_sees(name):
    model = tiny_llama(seed=1, **MODELS[name])
    cfg, g = model.config, torch.Generator().manual_seed(2)
    for attention in model.attentions():
        for norm in (attention.q_norm, attention.k_norm):
            if norm is not None:  # ones would hide a fold into the wrong norm
                norm.weight.data = torch.rand(cfg.head_dim, generator=g) + 0.5
    ids = torch.randint(0, cfg.vocab_size, (N,), generator=g)
    logits, kv = run(model, ids)
    scales = [random_scales(cfg.num_kv_heads, cfg.head_dim, g, shared=cfg.qk_norm) for _ in range(cfg.num_layers)]
    for attention, (k_scale, v_scale) in zip(model.attentions(), scales):
        attention.set_kv_balance(k_scale, v_scale)
    balanced_logits, balanced_kv = run(model, ids)
    assert torch.allclose(balanced_logits, logits, atol=2e-5, rtol=1e-5), (balanced_logits - logits).abs().max()
    for (k, v), (bk, bv), (k_scale, v_scale) in zip(kv, balanced_kv, scales):
        assert torch.allclose(bk, k * k_scale, atol=1e-5, rtol=1e-5), "the cache must see s k"
        assert torch.allclose(bv, v * v_scale, atol=1e-5, rtol=1e-5), "the cache must see t v"


def test_a_balance_replaces_the_one_folded_before_and_none_takes_it_out():
    model, g = tiny_llama(seed=3, num_heads=6, num_kv_heads=3, attention_bias=True), torch.Generator().manual_seed(4)
    cfg = model.config
    original = {n: p.clone() for n, p in model.named_parameters()}
    first, second = (random_scales(cfg.num_kv_heads, cfg.head_dim, g) for _ in range(2))
    attention = model.attentions()[0]
    attention.set_kv_balance(*first)
    attention.set_kv_balance(*second)
    twice = {n: p.clone() for n, p in model.named_parameters()}
    attention.set_kv_balance(None, None)
    for n, p in model.named_parameters():
        assert torch.allclose(p, original[n], rtol=1e-6, atol=1e-7), f"{n} not restored"
    assert attention.key_scale is None and attention.value_scale is None
    attention.set_kv_balance(*second)
    for n, p in model.named_parameters():
        assert torch.allclose(p, twice[n], rtol=1e-6, atol=1e-7), f"{n}: the second balance depends on the first"
    assert torch.equal(attention.key_scale, second[0]) and torch.equal(attention.value_scale, second[1])


def test_the_value_output_energy_is_that_of_the_model_as_loaded():
    model, g = tiny_llama(seed=5, num_heads=6, num_kv_heads=2), torch.Generator().manual_seed(6)
    cfg, attention = model.config, model.attentions()[1]
    group = cfg.num_heads // cfg.num_kv_heads
    columns = attention.o_proj.weight.double().pow(2).sum(0).view(cfg.num_heads, cfg.head_dim)
    want = torch.stack([columns[h * group : (h + 1) * group].sum(0) for h in range(cfg.num_kv_heads)])
    assert torch.allclose(attention.value_output_energy().double(), want, rtol=1e-6)
    attention.set_kv_balance(*random_scales(cfg.num_kv_heads, cfg.head_dim, g))
    assert torch.allclose(attention.value_output_energy().double(), want, rtol=1e-5), "must not see the balance"


def test_scales_that_cannot_fold_are_refused_with_the_reason():
    model = tiny_llama(seed=7, num_heads=4, num_kv_heads=2)
    attention, (h, d) = model.attentions()[0], (2, model.config.head_dim)
    before = attention.qkv_proj.weight.clone()
    with pytest.raises(ValueError, match="rotate-half pair"):
        attention.set_kv_balance(torch.rand(h, d) + 0.5, None)
    with pytest.raises(ValueError, match="positive and finite"):
        attention.set_kv_balance(None, torch.zeros(h, d))
    with pytest.raises(ValueError, match=r"shape \[2, 16\]"):
        attention.set_kv_balance(torch.ones(h, d // 2), None)
    qwen = tiny_llama(seed=7, num_heads=4, num_kv_heads=2, qk_norm=True, architecture="qwen3").attentions()[0]
    per_head = torch.arange(1.0, h + 1)[:, None].expand(h, d)
    with pytest.raises(ValueError, match="shared by all heads"):
        qwen.set_kv_balance(per_head, None)
    assert torch.equal(attention.qkv_proj.weight, before) and attention.key_scale is None, "a refusal changes nothing"


def error_product(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(sum a / s^2)(sum b s^2) per head: the mean squared score (or output) error of an even quantizer."""
    return (a / s**2).sum(-1) * (b * s**2).sum(-1)


def test_value_scales_reach_the_cauchy_schwarz_bound_and_key_scales_lower_the_error_halfway():
    g = torch.Generator().manual_seed(8)
    heads, d = 3, 64
    a, b = (torch.rand(heads, d, generator=g, dtype=torch.float64).pow(4) * 100 + 0.05 for _ in range(2))  # above the floor
    t = value_scales(a, b).double()
    bound = (a * b).sqrt().sum(-1) ** 2  # the least any scales can give
    assert torch.allclose(error_product(a, b, t), bound, rtol=1e-5)
    assert torch.allclose(t.log().mean(-1), torch.zeros(heads, dtype=torch.float64), atol=1e-6), "geometric mean 1"
    s = key_scales(a, b, per_head=True).double()
    assert torch.equal(s[:, : d // 2], s[:, d // 2 :]), "one scale per rotate-half pair"
    pa, pb = (x.unflatten(-1, (2, -1)).mean(-2).repeat(1, 2) for x in (a, b))  # what a pair shares
    unbalanced, best = error_product(pa, pb, torch.ones_like(s)), (pa * pb).sqrt().sum(-1) ** 2
    assert (error_product(pa, pb, s) < unbalanced).all() and (error_product(pa, pb, s) > best).all()
    shared = key_scales(a, b, per_head=False)
    assert torch.equal(shared, shared[:1].expand_as(shared)), "one K scale per channel for all heads"


def test_a_dead_channel_gets_a_finite_scale():
    energy = torch.rand(2, 64, generator=torch.Generator().manual_seed(9)) + 0.1
    dead = energy.clone()
    dead[0, 5] = dead[1, 37] = 0.0
    for scales in (value_scales(energy, dead), value_scales(dead, energy), key_scales(dead, energy, per_head=True)):
        assert torch.isfinite(scales).all() and (scales > 0).all()
