"""Turbo K/V transforms: measured once per model, deterministic, handed to every turbo store."""

import pytest
import torch
from runtime_toy import ToyConfig, ToyLoaded, ToyModel, make_engine

from server.kernels.paged_kv import AttentionMetadata, DenseKVStore
from server.kernels.turbo.store import TurboKVStore
from server.runtime import kv_calibration
from server.runtime.kv_calibration import (
    CALIBRATION_TEXT,
    KVStatistics,
    equalizing_transform,
    kv_statistics,
)  # fmt: skip
from server.runtime.sequence import SamplingParams

CONFIG = ToyConfig(head_dim=64)  # turbo needs head_dim % 64 == 0
CPU = torch.device("cpu")


class Spy(DenseKVStore):
    """A dense store that keeps every key, value and query it sees, in order."""

    def __init__(self, *args):
        super().__init__(*args)
        self.keys, self.values, self.queries = [], [], []

    def write(self, k, v, slot_mapping):
        self.keys.append(k.clone())
        self.values.append(v.clone())
        super().write(k, v, slot_mapping)

    def attend(self, q, meta, scale):
        self.queries.append(q.clone())
        return super().attend(q, meta, scale)


def spied_run(model, ids, first_position):
    """The model over ``ids`` at positions first_position.., in 16-token chunks (the statistics must not
    depend on how the text is cut): per layer (keys, values, queries) of tokens 1..n-1, float64."""
    n, c = len(ids), CONFIG
    spies = [Spy(-(-n // 16), 16, c.num_kv_heads, c.head_dim, torch.float32, "cpu") for _ in range(c.num_layers)]
    table = torch.arange(-(-n // 16), dtype=torch.int32)[None]
    with torch.no_grad():
        for start in range(0, n, 16):
            end = min(n, start + 16)
            meta = AttentionMetadata(torch.arange(start, end), table, torch.tensor([end], dtype=torch.int32),
                                     torch.tensor([0, end - start], dtype=torch.int32), [end], [end - start])
            model.forward(torch.tensor(ids[start:end]), torch.arange(start, end) + first_position, spies, meta)
    return [tuple(torch.cat(x)[1:].double() for x in (s.keys, s.values, s.queries)) for s in spies]


def test_statistics_are_their_definitions_over_every_position_shift_and_deterministic(monkeypatch):
    # The toy model has absolute position embeddings, so each shifted run really gives other keys.
    monkeypatch.setattr(kv_calibration, "POSITION_SHIFTS", (0, 200, 400))
    model = ToyModel(CONFIG, seed=3)
    ids = list(CALIBRATION_TEXT.encode())[:100]
    args = (model, ids, CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, CPU, torch.float32)
    first, again = kv_statistics(*args, max_positions=512), kv_statistics(*args, max_positions=512)
    runs = [spied_run(model, ids, p) for p in (0, 200, 400)]  # 400 + 100 tokens still fit in 512 positions
    only_first = kv_statistics(*args, max_positions=250)  # 200 + 100 > 250: the shifted runs are left out
    group = CONFIG.num_heads // CONFIG.num_kv_heads
    for layer in range(CONFIG.num_layers):
        k0, v0, _ = runs[0][layer]
        m = k0.mean(0)
        keys = torch.cat([run[layer][0] for run in runs])
        queries = torch.cat([run[layer][2] for run in runs])
        want = {"key_mean": m, "key_spread": (keys - m).pow(2).mean(0), "value_power": v0.pow(2).mean(0),
                "query_power": torch.stack([queries[:, h * group:(h + 1) * group].pow(2).mean((0, 1))
                                            for h in range(CONFIG.num_kv_heads)])}
        for name, value in want.items():
            got = getattr(first[layer], name)
            assert got.shape == (CONFIG.num_kv_heads, CONFIG.head_dim) and got.dtype == torch.float32
            assert torch.equal(got, getattr(again[layer], name)), f"layer {layer} {name}: not deterministic"
            assert torch.allclose(got.double(), value, rtol=1e-4, atol=1e-5), f"layer {layer} {name} differs"
        spread_first = (k0 - m).pow(2).mean(0)
        assert torch.allclose(only_first[layer].key_spread.double(), spread_first, rtol=1e-4, atol=1e-5)


def score_error(s, a, b):
    """(sum s^2 a)(sum b / s^2) per head: the mean squared score error up to a constant factor."""
    return (s.pow(2) * a).sum(-1) * (b / s.pow(2)).sum(-1)


def test_scales_are_powers_of_two_near_the_cauchy_schwarz_optimum():
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.exp(2 * torch.randn(3, 64, generator=gen)) for _ in range(3))  # channels 100x apart
    _, s, t = equalizing_transform(KVStatistics(torch.randn(3, 64, generator=gen), a, b, c))
    for name, x in (("s", s), ("t", t)):
        assert torch.equal(x, torch.exp2(torch.log2(x).round())), f"{name} is not a power of two"
        assert x.log2().mean(-1).abs().max() <= 0.5, f"{name}: geometric mean per head is not ~1"
    # Rounding log2 s to an integer moves s^2 by up to 2x per channel: about 1.17x the optimum on average
    # ((E 2^(2u))^2, u uniform in [-1/2, 1/2]).
    best = (a * b).sqrt().sum(-1).pow(2)  # Cauchy-Schwarz bound, reached by s^4 = b / a exactly
    got, plain = score_error(s, a, b), score_error(torch.ones_like(s), a, b)
    assert (got <= 1.3 * best).all() and (got < plain / 3).all(), (got / best, plain / best)
    ones = torch.ones_like(c)  # values: every output channel counts the same
    assert (score_error(t, c, ones) <= 1.3 * c.sqrt().sum(-1).pow(2)).all()


def test_dead_channels_get_finite_scales():
    a = torch.ones(2, 64)
    a[0, :3] = 0.0  # a channel whose key never moves, one whose query is always 0, a value always 0
    b, c = torch.ones(2, 64), torch.ones(2, 64)
    b[1, 5], c[1, 7] = 0.0, 0.0
    _, s, t = equalizing_transform(KVStatistics(torch.zeros(2, 64), a, b, c))
    for x in (s, t):
        assert torch.isfinite(x).all() and x.log2().abs().max() <= kv_calibration.MAX_SCALE_EXPONENT
    store = TurboKVStore(1, 16, 2, 64, "turbo3", "turbo3", "cpu", torch.float32)
    store.set_transform(None, s, t)  # accepted as they are


def test_turbo_engine_gives_every_store_its_layer_offset_and_dense_engines_none():
    loaded = ToyLoaded(model=ToyModel(CONFIG, seed=3), config=CONFIG)
    engines = [make_engine(loaded, num_pages=64, max_model_len=128, kv_cache_dtype=kind) for kind in ("turbo3", "f32")]
    try:
        turbo, dense = engines
        ids = list(CALIBRATION_TEXT.encode())[:128]  # the byte tokenizer, cut at max_model_len
        stats = kv_statistics(loaded.model, ids, CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, CPU,
                              torch.float32, max_positions=128)
        for store, layer in zip(turbo.kv_cache.stores, stats):
            assert isinstance(store, TurboKVStore) and torch.equal(store.k_offset, layer.key_mean)
            assert not store.scaled, "engines apply m only (kv_calibration.py: s and t measured not to pay)"
        assert all(not hasattr(s, "k_offset") for s in dense.kv_cache.stores)
        # Same model, same text: a second turbo engine calibrates to the very same transforms.
        again = make_engine(loaded, num_pages=64, max_model_len=128, kv_cache_dtype="turbo4",
                            kv_cache_dtype_v="turbo2")
        engines.append(again)
        for a, b in zip(turbo.kv_cache.stores, again.kv_cache.stores):
            assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("k_offset", "k_scale", "v_scale"))
        out = turbo.generate(list(b"hello there"), SamplingParams(max_tokens=4, temperature=0.0))
        assert out.finish_reason == "length" and len(out.token_ids) == 4
    finally:
        for engine in engines:
            engine.shutdown()


def test_equalize_gives_every_store_its_layer_scales_too():
    model, tokenizer = ToyModel(CONFIG, seed=4), ToyLoaded(model=None).tokenizer
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # channels of very different spread, so that the scales are not all 1
        for layer in model.layers:
            for name in ("k", "v"):
                layer[name].mul_(torch.exp(2 * torch.randn(layer[name].shape[0], 1, generator=gen)))
    stores = [TurboKVStore(4, 16, CONFIG.num_kv_heads, CONFIG.head_dim, "turbo3", "turbo3", "cpu", torch.float32)
              for _ in range(CONFIG.num_layers)]
    kv_calibration.calibrate_turbo_stores(model, tokenizer, stores, CONFIG.num_kv_heads, CONFIG.head_dim, CPU,
                                          torch.float32, max_tokens=128, equalize=True)
    ids = tokenizer.encode(CALIBRATION_TEXT)[:128]
    stats = kv_statistics(model, ids, CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, CPU, torch.float32,
                          max_positions=128)
    for store, layer in zip(stores, stats):
        m, s, t = equalizing_transform(layer)
        assert store.scaled and not (s.eq(1).all() or t.eq(1).all())
        assert torch.equal(store.k_offset, m) and torch.equal(store.k_scale, s) and torch.equal(store.v_scale, t)


def test_too_little_text_is_refused():
    with pytest.raises(ValueError, match="more than 1 tokens"):
        kv_statistics(ToyModel(CONFIG), [5], CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, CPU,
                      torch.float32, max_positions=128)
