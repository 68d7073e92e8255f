"""Key offsets for turbo K caches: measured once per model, deterministic, handed to every turbo store."""

import math

import pytest
import torch
from prometheus_client import REGISTRY

from runtime_toy import ToyConfig, ToyLoaded, ToyModel, make_engine
from server.kernels.paged_kv import AttentionMetadata, DenseKVStore
from server.kernels.turbo.store import TurboKVStore
from server.runtime.kv_calibration import CALIBRATION_TEXT, key_offsets, turned_pair_gains, turned_pairs
from server.runtime.sequence import SamplingParams
from tests.models.tiny_llama import tiny_llama

CONFIG = ToyConfig(head_dim=64)  # turbo needs head_dim % 64 == 0


class KeySpy(DenseKVStore):
    """A dense store that keeps every key written to it, in order."""

    def __init__(self, *args):
        super().__init__(*args)
        self.keys = []

    def write(self, k, v, slot_mapping, positions):
        self.keys.append(k.clone())
        super().write(k, v, slot_mapping, positions)


def build_info(model_name: str) -> dict:
    """The labels of turboserve_build_info for ``model_name`` as /metrics would show them now."""
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == "turboserve_build_info" and sample.labels.get("model_name") == model_name:
                return sample.labels
    raise AssertionError(f"no turboserve_build_info for {model_name!r}")


def tiny_rope_model():
    model = tiny_llama(vocab_size=64, hidden_size=48, intermediate_size=64, rope_theta=100.0,
                       max_position_embeddings=512, tie_word_embeddings=True)
    return model, model.config


def spied_offsets(model, cfg, ids):
    """The definition, computed apart: run the model over ``ids`` in 16-token chunks, turn each written key
    back to position 0 with complex numbers (pair f = (f, f + D/2) times e^(-i p theta_f)), average keys
    1..n-1; the sink is key 0 as written; also the mean of keys 1..n-1 as written."""
    n, d = len(ids), cfg.head_dim
    spies = [KeySpy(-(-n // 16), 16, cfg.num_kv_heads, d, torch.float32, "cpu") for _ in range(cfg.num_layers)]
    table = torch.arange(-(-n // 16), dtype=torch.int32)[None]
    with torch.no_grad():
        for start in range(0, n, 16):  # chunked prefill: the keys must not depend on how the text is cut
            end = min(n, start + 16)
            meta = AttentionMetadata(torch.arange(start, end), table, torch.tensor([end], dtype=torch.int32),
                                     torch.tensor([0, end - start], dtype=torch.int32), [end], [end - start])
            model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), spies, meta)
    theta = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    back = torch.polar(torch.ones(n, d // 2, dtype=torch.float64), -torch.arange(n)[:, None].double() * theta)
    out = []
    for spy in spies:
        k = torch.cat(spy.keys).double()
        turned = torch.complex(k[..., : d // 2], k[..., d // 2 :]) * back[:, None]
        out.append((torch.cat([turned.real, turned.imag], -1)[1:].mean(0), k[0], k[1:].mean(0)))
    return out


def test_key_offsets_turn_the_keys_back_to_position_zero_and_keep_the_sink():
    model, cfg = tiny_rope_model()
    ids = torch.randint(0, cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    args = (model, ids, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.device("cpu"), torch.float32)
    first, again = key_offsets(*args, cfg.head_dim // 2), key_offsets(*args, cfg.head_dim // 2)
    for layer, (got, got_again, (mean, sink, _)) in enumerate(zip(first, again, spied_offsets(model, cfg, ids))):
        assert got.mean.shape == (cfg.num_kv_heads, cfg.head_dim) and got.mean.dtype == torch.float32
        assert torch.equal(got.mean, got_again.mean) and torch.equal(got.sink, got_again.sink), "not deterministic"
        assert torch.allclose(got.mean.double(), mean, atol=1e-5), f"layer {layer}: not the mean turned-back key"
        assert torch.allclose(got.sink.double(), sink, atol=1e-6), f"layer {layer}: the sink is not key 0"
        assert torch.equal(got.inv_freq, model.rope_inv_freq())
        assert got.const.eq(0).all() and got.pairs.tolist() == [list(range(cfg.head_dim // 2))] * cfg.num_kv_heads


def test_partial_key_offsets_turn_the_pairs_that_gain_most_and_keep_the_mean_written_key_on_the_rest():
    """Turning pair f removes n (|m_f|^2 - |c_f|^2) more of the keys' squared length than the constant c_f
    (m the mean turned-back key, c the mean written key): the P pairs with the largest gain turn, with m
    there and const 0; the others keep c and a zero mean."""
    model, cfg = tiny_rope_model()
    ids = torch.randint(0, cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    d, turned_pairs = cfg.head_dim, 3
    got = key_offsets(model, ids, cfg.num_layers, cfg.num_kv_heads, d, torch.device("cpu"), torch.float32,
                      turned_pairs)
    for layer, (offset, (mean, sink, written)) in enumerate(zip(got, spied_offsets(model, cfg, ids))):
        for h in range(cfg.num_kv_heads):
            m = torch.complex(mean[h, : d // 2], mean[h, d // 2 :])
            c = torch.complex(written[h, : d // 2], written[h, d // 2 :])
            gains = m.abs() ** 2 - c.abs() ** 2
            want = sorted(gains.argsort(descending=True)[:turned_pairs].tolist())
            assert offset.pairs[h].tolist() == want, f"layer {layer} head {h}: gains {gains.tolist()}"
            turn = torch.zeros(d // 2, dtype=torch.bool)
            turn[want] = True
            turn = turn.repeat(2)
            assert torch.allclose(offset.mean[h].double(), torch.where(turn, mean[h], 0.0), atol=1e-5)
            assert torch.allclose(offset.const[h].double(), torch.where(turn, 0.0, written[h]), atol=1e-5)
        assert torch.allclose(offset.sink.double(), sink, atol=1e-6) and offset.turns


def test_fixed_key_offsets_are_the_mean_written_key_at_every_position():
    model, cfg = tiny_rope_model()
    ids = torch.randint(0, cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(2)).tolist()
    got = key_offsets(model, ids, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.device("cpu"),
                      torch.float32, 0)
    n, d = len(ids), cfg.head_dim
    spies = [KeySpy(-(-n // 16), 16, cfg.num_kv_heads, d, torch.float32, "cpu") for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.arange(n), torch.arange(-(-n // 16), dtype=torch.int32)[None],
                             torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), [n], [n])
    with torch.no_grad():
        model.forward(torch.tensor(ids), torch.arange(n), spies, meta)
    for layer, (offset, spy) in enumerate(zip(got, spies)):
        want = spy.keys[0][1:].double().mean(0)
        assert torch.allclose(offset.const.double(), want, atol=1e-5), f"layer {layer}: not the mean written key"
        assert torch.equal(offset.sink, offset.const) and offset.mean.eq(0).all() and offset.pairs.shape[1] == 0
        assert not offset.turns, "a fixed offset never turns"


def test_turbo_engines_give_every_store_its_layer_offset_of_the_chosen_kind_and_dense_engines_none():
    loaded = ToyLoaded(model=ToyModel(CONFIG, seed=3), config=CONFIG)
    engines = [make_engine(loaded, num_pages=1024, max_model_len=128, kv_cache_dtype="turbo3")]
    try:
        turbo = engines[0]  # --kv-key-offset partial --kv-key-turned-pairs 8, the default
        info = build_info(turbo.model_name)  # /metrics says which offset runs (the engines share the toy's name)
        assert (info["kv_key_offset"], info["kv_key_turned_pairs"]) == ("partial", "8")
        dense = make_engine(loaded, num_pages=64, max_model_len=128, kv_cache_dtype="f32")
        engines.append(dense)
        info = build_info(dense.model_name)
        assert (info["kv_key_offset"], info["kv_key_turned_pairs"]) == ("none", "0")
        ids = list(CALIBRATION_TEXT.encode())[:128]  # the byte tokenizer, cut at max_model_len
        args = (loaded.model, ids, CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, torch.device("cpu"),
                torch.float32)
        for store, o in zip(turbo.kv_cache.stores, key_offsets(*args, 8, context=128)):  # max_model_len
            assert isinstance(store, TurboKVStore) and store.offset_turns
            assert store.key_offset.pairs.shape == (CONFIG.num_kv_heads, 8)
            assert all(torch.equal(getattr(store.key_offset, n), getattr(o, n)) for n in ("const", "mean", "pairs"))
        assert all(not hasattr(s, "key_offset") for s in dense.kv_cache.stores)
        turned = make_engine(loaded, num_pages=1024, max_model_len=128, kv_cache_dtype="turbo4",
                             kv_cache_dtype_v="turbo2", kv_key_offset="turned")
        info = build_info(turned.model_name)
        assert (info["kv_key_offset"], info["kv_key_turned_pairs"]) == ("turned", str(CONFIG.head_dim // 2))
        none = make_engine(loaded, num_pages=1024, max_model_len=128, kv_cache_dtype="turbo3", kv_key_offset="none")
        engines += [turned, none]
        for store, o in zip(turned.kv_cache.stores, key_offsets(*args, CONFIG.head_dim // 2)):
            assert torch.equal(store.key_offset.mean, o.mean) and torch.equal(store.key_offset.sink, o.sink)
            assert store.offset_turns, "the sink at position 0 differs from the mean: the offset turns"
        assert all(s.key_offset is None for s in none.kv_cache.stores), "none: the spec's plain format"
        fixed = make_engine(loaded, num_pages=1024, max_model_len=128, kv_cache_dtype="turbo3", kv_key_offset="fixed",
                            kv_key_turned_pairs=5)  # the pair count applies to partial only
        engines.append(fixed)
        for store, o in zip(fixed.kv_cache.stores, key_offsets(*args, 0)):
            assert not store.offset_turns and store.key_offset.pairs.shape == (CONFIG.num_kv_heads, 0)
            assert torch.equal(store.key_offset.const, o.const) and torch.equal(store.key_offset.sink, o.sink)
        for engine in (turbo, turned, none, fixed):
            out = engine.generate(list(b"hello there"), SamplingParams(max_tokens=4, temperature=0.0))
            assert out.finish_reason == "length" and len(out.token_ids) == 4
    finally:
        for engine in engines:
            engine.shutdown()


def test_a_key_offset_asked_of_a_dense_cache_is_ignored_with_a_warning(caplog):
    loaded = ToyLoaded(model=ToyModel(CONFIG, seed=3), config=CONFIG)
    with caplog.at_level("WARNING", logger="server.runtime.engine"):
        engine = make_engine(loaded, num_pages=64, max_model_len=128, kv_cache_dtype="f32", kv_key_offset="turned")
    try:
        assert "--kv-key-offset turned ignored" in caplog.text and "stored as f32" in caplog.text
        assert all(not hasattr(s, "key_offset") for s in engine.kv_cache.stores)
    finally:
        engine.shutdown()


def test_a_partial_offset_with_a_bad_pair_count_is_refused_with_the_range():
    loaded = ToyLoaded(model=ToyModel(CONFIG, seed=3), config=CONFIG)
    for bad in (0, CONFIG.head_dim // 2 + 1):
        with pytest.raises(ValueError, match=rf"--kv-key-turned-pairs must be in 1 \.\. {CONFIG.head_dim // 2} .*"
                                             rf"got {bad}"):
            make_engine(loaded, num_pages=1024, max_model_len=128, kv_cache_dtype="turbo3", kv_key_offset="partial",
                        kv_key_turned_pairs=bad)


def test_pair_gains_over_a_longer_context_count_the_pairs_too_slow_to_turn_in_the_calibration_text():
    """A pair whose angle moves 0.1 rad over 100 calibration keys looks constant there (m = c: no gain), but over
    10,000 positions a constant keeps only |sinc|^2 of it: (1 - |mean e^(i p theta)|^2) |m|^2 is the gain, in
    closed form here (geometric series). A fast pair keeps its measured |m|^2 - |c|^2."""
    slow, fast = 1e-3, 1.0
    inv_freq = torch.tensor([slow, fast])
    # [1 head, D = 4]: pair 0 = (0, 2), pair 1 = (1, 3); m: (3, 0) and (2, 0); c: (3, 0) and (0.5, 0)
    turned_back, written = torch.tensor([[3.0, 2.0, 0.0, 0.0]]), torch.tensor([[3.0, 0.5, 0.0, 0.0]])
    measured = turned_pair_gains(written, turned_back, inv_freq, keys=100)
    assert torch.allclose(measured, torch.tensor([[0.0, 4.0 - 0.25]]))

    def kept(theta, n):  # |(1/n) sum_{p=1..n} e^(i p theta)|^2 = (sin(n theta / 2) / (n sin(theta / 2)))^2
        return (math.sin(n * theta / 2) / (n * math.sin(theta / 2))) ** 2

    long = turned_pair_gains(written, turned_back, inv_freq, keys=100, context=10000).double()
    want = torch.tensor([9 * (1 - kept(slow, 10000)) - 9 * (1 - kept(slow, 100)),
                         4 * (1 - kept(fast, 10000)) - 0.25 * (1 - kept(fast, 100))], dtype=torch.float64)
    assert torch.allclose(long[0], want, rtol=1e-4), (long, want)
    assert long[0, 0] > 5, "the slow pair must gain over a long context"


def test_the_turned_pair_count_of_each_offset_kind():
    assert [turned_pairs(kind, None, 128) for kind in ("fixed", "partial", "turned", "none")] == [0, 8, 64, 0]
    assert turned_pairs("partial", None, 8) == 4, "the default turns all pairs of a head with fewer than 8"
    assert turned_pairs("partial", 3, 64) == 3 and turned_pairs("fixed", 5, 64) == 0


def test_a_balanced_engine_gives_its_stores_the_offsets_of_the_keys_the_balanced_model_writes():
    """The offsets come after the fold: those of the keys the balanced model writes (its own calibration
    forward, computed apart here); with ``none`` the model is balanced and the stores keep the plain format."""
    model = tiny_llama(vocab_size=257, hidden_size=64, intermediate_size=64, num_heads=4, num_kv_heads=2,
                       head_dim=64, rope_theta=100.0, max_position_embeddings=512, tie_word_embeddings=True)
    loaded = ToyLoaded(model=model, config=model.config)
    engine = make_engine(loaded, num_pages=1024, max_model_len=128, kv_cache_dtype="turbo3")
    try:
        assert all(a.key_scale is not None and a.value_scale is not None for a in model.attentions())
        assert build_info(engine.model_name)["kv_balance"] == "on"
        ids = list(CALIBRATION_TEXT.encode())[:128]
        args = (model, ids, 2, 2, 64, torch.device("cpu"), torch.float32)
        for store, want in zip(engine.kv_cache.stores, key_offsets(*args, 8, context=128)):  # the balanced model
            assert torch.equal(store.key_offset.pairs, want.pairs)
            for name in ("const", "mean", "sink"):
                assert torch.allclose(getattr(store.key_offset, name), getattr(want, name), atol=1e-5, rtol=1e-5)
        out = engine.generate(list(b"hello there"), SamplingParams(max_tokens=4, temperature=0.0))
        assert out.finish_reason == "length" and len(out.token_ids) == 4
    finally:
        engine.shutdown()
    plain = make_engine(loaded, num_pages=1024, max_model_len=128, kv_cache_dtype="turbo3", kv_key_offset="none")
    try:
        assert all(s.key_offset is None for s in plain.kv_cache.stores), "none: the spec's plain format"
        assert all(a.key_scale is not None for a in model.attentions()), "balanced without an offset too"
    finally:
        plain.shutdown()
