"""Key offsets for turbo K caches: measured once per model, deterministic, handed to every turbo store."""

import torch

from runtime_toy import ToyConfig, ToyLoaded, ToyModel, make_engine
from server.kernels.paged_kv import AttentionMetadata, DenseKVStore
from server.kernels.turbo.store import TurboKVStore
from server.runtime.kv_calibration import CALIBRATION_TEXT, mean_keys
from server.runtime.sequence import SamplingParams

CONFIG = ToyConfig(head_dim=64)  # turbo needs head_dim % 64 == 0


class KeySpy(DenseKVStore):
    """A dense store that keeps every key written to it, in order."""

    def __init__(self, *args):
        super().__init__(*args)
        self.keys = []

    def write(self, k, v, slot_mapping):
        self.keys.append(k.clone())
        super().write(k, v, slot_mapping)


def spied_mean_keys(model, ids):
    """The definition, computed apart: run the model over ``ids`` in 16-token chunks, average keys 1..n-1."""
    n, c = len(ids), CONFIG
    spies = [KeySpy(-(-n // 16), 16, c.num_kv_heads, c.head_dim, torch.float32, "cpu") for _ in range(c.num_layers)]
    table = torch.arange(-(-n // 16), dtype=torch.int32)[None]
    with torch.no_grad():
        for start in range(0, n, 16):  # chunked prefill: the keys must not depend on how the text is cut
            end = min(n, start + 16)
            meta = AttentionMetadata(torch.arange(start, end), table, torch.tensor([end], dtype=torch.int32),
                                     torch.tensor([0, end - start], dtype=torch.int32), [end], [end - start])
            model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), spies, meta)
    return [torch.cat(s.keys)[1:].double().mean(0) for s in spies]


def test_mean_keys_is_the_mean_key_after_the_first_token_and_deterministic():
    model = ToyModel(CONFIG, seed=3)
    ids = list(CALIBRATION_TEXT.encode())[:100]
    first = mean_keys(model, ids, CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, torch.device("cpu"),
                      torch.float32)
    again = mean_keys(model, ids, CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, torch.device("cpu"),
                      torch.float32)
    want = spied_mean_keys(model, ids)
    for layer, (m, m_again, m_want) in enumerate(zip(first, again, want)):
        assert m.shape == (CONFIG.num_kv_heads, CONFIG.head_dim) and m.dtype == torch.float32
        assert torch.equal(m, m_again), f"layer {layer}: calibration is not deterministic"
        assert torch.allclose(m.double(), m_want, atol=1e-5), f"layer {layer}: not the mean of keys 1..n-1"


def test_turbo_engine_gives_every_store_its_layer_offset_and_dense_engines_none():
    loaded = ToyLoaded(model=ToyModel(CONFIG, seed=3), config=CONFIG)
    engines = [make_engine(loaded, num_pages=64, max_model_len=128, kv_cache_dtype=kind) for kind in ("turbo3", "f32")]
    try:
        turbo, dense = engines
        ids = list(CALIBRATION_TEXT.encode())[:128]  # the byte tokenizer, cut at max_model_len
        want = mean_keys(loaded.model, ids, CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim,
                         torch.device("cpu"), torch.float32)
        for store, m in zip(turbo.kv_cache.stores, want):
            assert isinstance(store, TurboKVStore) and torch.equal(store.k_offset, m)
        assert all(not hasattr(s, "k_offset") for s in dense.kv_cache.stores)
        # Same model, same text: a second turbo engine calibrates to the very same offsets.
        again = make_engine(loaded, num_pages=64, max_model_len=128, kv_cache_dtype="turbo4",
                            kv_cache_dtype_v="turbo2")
        engines.append(again)
        for a, b in zip(turbo.kv_cache.stores, again.kv_cache.stores):
            assert torch.equal(a.k_offset, b.k_offset)
        out = turbo.generate(list(b"hello there"), SamplingParams(max_tokens=4, temperature=0.0))
        assert out.finish_reason == "length" and len(out.token_ids) == 4
    finally:
        for engine in engines:
            engine.shutdown()
