"""The CUDA C turbo decode (attention_cuda.py) on the GPU vs a float64 oracle, the float32 decode-then-attend
reference and the Triton decode: head dims 64/128/256, GQA 1-8, mixed K/V kinds, lengths around page and
tile boundaries, shuffled block tables, page sizes that do and do not hold whole 16-token tiles, key
offsets none/partial/turned, one and several splits, CUDA-graph replay at other lengths, and the
fallbacks (None: the caller takes Triton). The int8-keys build (scores by int8 mmas) is checked against a float64
oracle of what it defines (int8_keys_oracle: the query and centroids rounded to int8, nothing else) at the fp16
build's tolerance; how far that definition is from the exact scores is checked on CPU against the rounding
analysis (test_int8_key_scores_error_follows_the_rounding_analysis).

The kernel cases are skipped without CUDA: the kernel is CUDA C that NVRTC compiles at run time on an NVIDIA
GPU (the CPU suite compiles nothing; bench/cuda_sass.py builds it offline for sm_90). The split rule, the CTA
width and the int8 centroid tables (through a model of PRMT) are plain Python, checked everywhere.
"""

import dataclasses

import pytest
import torch
from test_attention import attention64, decode64, oracle, scenario
from test_decode_key_offset import decode_case, offset_for
from test_key_offset import offset64, represented_keys, rope_keys
from test_recent_decode import window_oracle64
from turbo_oracle import rotation_matrix64, shuffled_tables, slots_of

from server.kernels.paged_kv import AttentionMetadata
from server.kernels.turbo import attention_cuda
from server.kernels.turbo import store as store_module
from server.kernels.turbo.attention import (
    attention_over_decoded_pages,
    decode_attention_triton,
)
from server.kernels.turbo.codebook import codebook
from server.kernels.turbo.format import group_size, quantize_reference, unpack_indices
from server.kernels.turbo.recent import (
    RecentWindow,
    attention_with_recent_reference,
    recent_values,
)
from server.kernels.turbo.store import TurboKVStore

needs_gpu = pytest.mark.gpu  # NVRTC compiles the kernel on an NVIDIA GPU: tests/conftest.py skips it elsewhere

GPU = torch.device("cuda")
MIXED_LENGTHS = [1, 2, 15, 16, 17, 1000]  # page 16: page_size - 1, page_size, page_size + 1; 1000: many tiles


def on_gpu(store, meta, q, dtype):
    """The CPU-built store's pages, signs and offset, the metadata and the queries (as ``dtype``) on the GPU."""
    k, v = (dataclasses.replace(p, **{f.name: getattr(p, f.name).to(GPU) for f in dataclasses.fields(p)
                                      if isinstance(getattr(p, f.name), torch.Tensor)}) for p in (store.k, store.v))
    offset = store.key_offset
    if offset is not None and store.offset_turns:
        offset = type(offset)(*(getattr(offset, f.name).to(GPU) for f in dataclasses.fields(offset)))
    else:
        offset = None
    meta = AttentionMetadata(meta.slot_mapping.to(GPU), meta.block_tables.to(GPU), meta.seq_lens.to(GPU),
                             meta.query_start_loc.to(GPU), meta.seq_lens_cpu, meta.query_lens_cpu)
    signs = tuple(s.to(GPU) for s in store.signs)
    return k, v, offset, meta, q.to(GPU, dtype), signs


def cuda_decode(store, meta, q, dtype=torch.float16, splits=None, triton=True, **launch):
    """(CUDA decode, Triton decode or None) on the GPU, as float64 on the CPU. The Triton comparison is
    optional: each of its specializations costs a JIT compile of seconds (device time)."""
    k, v, offset, meta, q, signs = on_gpu(store, meta, q, dtype)
    out = attention_cuda.decode_attention_cuda(q, k, v, meta, store.head_dim**-0.5, signs, store.inv_sqrt, offset,
                                               num_splits=splits, **launch)
    assert not attention_cuda._COUNTERS[q.device].any(), "the last CTA of each row must leave its split counter at 0"
    assert out is not None, "the CUDA kernel refused a supported call (NVRTC missing or the source refused?)"
    assert out.dtype == dtype and out.shape == q.shape
    if not triton:
        return out.double().cpu(), None
    fused = decode_attention_triton(q, k, v, meta, store.head_dim**-0.5, signs, store.inv_sqrt, offset,
                                    num_splits=splits)
    return out.double().cpu(), fused.double().cpu()


def int8_query(rotated):
    """The int8 build's query per head and group (last dim): the nearest multiple of max |q'| / 127."""
    step = rotated.abs().amax(-1, keepdim=True) / 127
    return torch.where(step > 0, torch.round(rotated / step), 0.0) * step


def int8_keys_oracle(q, store, meta, scale, keys=None):
    """Float64 attention as the int8-keys build defines its scores: per head and group the rotated query as
    int8_query gives it, the keys decoded with attention_cuda.int8_centroids, plus <q, o(p)> at full precision
    with a key offset (``keys``: the represented keys, decoded pages + o(p)). q: float64 queries."""
    head_dim, group = store.head_dim, group_size(store.head_dim)
    r = rotation_matrix64(group)
    c8, unit = attention_cuda.int8_centroids(store.k.bits, group)
    idx = unpack_indices(store.k.codes, store.k.bits, head_dim)
    k8 = (torch.tensor(c8, dtype=torch.float64)[idx] * unit).reshape(*idx.shape[:-1], head_dim // group, group)
    k8 = ((k8 * store.k.norms.double()[..., None]) @ r).reshape(idx.shape).transpose(1, 2)
    rotated = q.reshape(*q.shape[:-1], head_dim // group, group) @ r.T
    q8 = (int8_query(rotated) @ r).reshape(q.shape)
    offset = torch.zeros_like(k8) if keys is None else keys - decode64(store.k, head_dim)
    v = decode64(store.v, head_dim)  # q8 . k8 + q . o(p) as one dot product of the concatenations
    out = attention64(torch.cat([q8, q], -1), torch.cat([k8, offset], -1), torch.cat([v, torch.zeros_like(v)], -1),
                      meta, scale)
    return out[..., :head_dim]


def assert_close(got, want, rel, what):
    err = (got - want).abs().max().item()
    tol = rel * want.abs().max().item()
    assert err < tol, f"{what}: max abs error {err:.3g} >= {tol:.3g}"


@needs_gpu
@pytest.mark.parametrize("int8_keys", [False, True], ids=["fp16_keys", "int8_keys"])
@pytest.mark.parametrize(
    "head_dim,gqa,k_kind,v_kind",
    [(64, 1, "turbo3", "turbo3"), (64, 8, "turbo2", "turbo4"), (64, 5, "turbo4", "turbo2"),
     (128, 2, "turbo4", "turbo3"), (128, 3, "turbo3", "turbo3"), (128, 4, "turbo3", "turbo3"),
     (128, 5, "turbo2", "turbo2"), (128, 8, "turbo4", "turbo4"), (256, 4, "turbo4", "turbo2"),
     (256, 1, "turbo3", "turbo3"), (256, 8, "turbo2", "turbo3")],
)
def test_cuda_decode_matches_float64_and_triton(head_dim, gqa, k_kind, v_kind, int8_keys):
    """fp16 queries: the error is the fp16 rounding of Q, P and the centroids (~1e-3 of the output's scale); the
    int8 build's vs its own definition: the same fp16 rounding of P and V (its scores are exact int32 sums)."""
    store, meta, q = scenario(MIXED_LENGTHS, [1] * len(MIXED_LENGTHS), 2, gqa, head_dim, k_kind, v_kind,
                              seed=head_dim + gqa)
    q64 = q.half().double()
    want = (int8_keys_oracle if int8_keys else oracle)(q64, store, meta, head_dim**-0.5)
    for splits in (1, 3, None):
        got, triton = cuda_decode(store, meta, q, splits=splits, triton=gqa in (4, 8) and not int8_keys,
                                  int8_keys=int8_keys)
        assert_close(got, want, 3e-3, f"CUDA decode (int8 keys {int8_keys}), {splits} splits, vs float64")
        if triton is not None:
            assert_close(got, triton, 3e-3, f"CUDA decode, {splits} splits, vs Triton")


@needs_gpu
@pytest.mark.parametrize("int8_keys", [False, True], ids=["fp16_keys", "int8_keys"])
@pytest.mark.parametrize("warps,blocks", [(4, None), (8, None)])
def test_cuda_decode_launch_settings(warps, blocks, int8_keys):
    """Both CTA widths of the benchmark's sweep (bench/turbo_decode_sweep.py) at any head dim: 4 warps (the
    default at D = 256) and 8 (the default elsewhere; at D = 256 their outputs do not fit in shared memory:
    None, a Triton fallback), with and without a key offset."""
    wide = 128 if warps == 8 else 256
    for head_dim, gqa, k_kind, v_kind in ((64, 3, "turbo3", "turbo4"), (wide, 2, "turbo4", "turbo3")):
        store, meta, q = scenario(MIXED_LENGTHS, [1] * len(MIXED_LENGTHS), 2, gqa, head_dim, k_kind, v_kind,
                                  seed=warps)
        want = (int8_keys_oracle if int8_keys else oracle)(q.half().double(), store, meta, head_dim**-0.5)
        for splits in (1, 3):
            got, _ = cuda_decode(store, meta, q, splits=splits, triton=False, warps=warps, blocks=blocks,
                                 int8_keys=int8_keys)
            assert_close(got, want, 3e-3, f"{warps} warps, {blocks} blocks, {splits} splits")
    store, meta, q, _ = decode_case([1, 17, 300], 2, 4, 128, "turbo3", "turbo3", 500000.0, seed=5, turned_pairs=8)
    want = offset_oracle(store, meta, q.half().double(), int8_keys)
    got, _ = cuda_decode(store, meta, q, splits=2, triton=False, warps=warps, blocks=blocks, int8_keys=int8_keys)
    assert_close(got, want, 3e-3, f"{warps} warps, {blocks} blocks, key offset")
    if warps == 8:
        store, meta, q = scenario([40], [1], 1, 2, 256, "turbo3", "turbo3", seed=1)
        k, v, _, gmeta, gq, signs = on_gpu(store, meta, q, torch.float16)
        assert attention_cuda.decode_attention_cuda(gq, k, v, gmeta, 0.0625, signs, store.inv_sqrt, warps=8) is None


@needs_gpu
@pytest.mark.parametrize("int8_keys", [False, True], ids=["fp16_keys", "int8_keys"])
def test_cuda_decode_with_bf16_queries_within_bf16_rounding(int8_keys):
    store, meta, q = scenario(MIXED_LENGTHS, [1] * len(MIXED_LENGTHS), 2, 4, 128, "turbo3", "turbo4", seed=3)
    want = (int8_keys_oracle if int8_keys else oracle)(q.bfloat16().double(), store, meta, 128**-0.5)
    got, triton = cuda_decode(store, meta, q, dtype=torch.bfloat16, triton=not int8_keys, int8_keys=int8_keys)
    assert_close(got, want, 1.5e-2, "bf16 CUDA decode vs float64")  # bf16 output: 2^-8 relative rounding
    if triton is not None:
        assert_close(got, triton, 1.5e-2, "bf16 CUDA decode vs Triton")


def paged_store(seq_lens, page_size, kv_heads, head_dim, k_kind, v_kind, seed):
    """Random K/V in shuffled pages of ``page_size`` tokens (not 16: the oracle's pages are), decode metadata."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_pages = shuffled_tables(seq_lens, page_size, gen)
    store = TurboKVStore(num_pages, page_size, kv_heads, head_dim, k_kind, v_kind, "cpu", torch.float32)
    for s, n in enumerate(seq_lens):
        slots = slots_of(tables[s], torch.arange(n), page_size)
        store.write(torch.randn(n, kv_heads, head_dim, generator=gen) * 2 + 0.5,
                    torch.randn(n, kv_heads, head_dim, generator=gen), slots, torch.arange(n))
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), tables, torch.tensor(seq_lens, dtype=torch.int32),
                             torch.arange(len(seq_lens) + 1, dtype=torch.int32), list(seq_lens), [1] * len(seq_lens))
    return store, meta


@needs_gpu
@pytest.mark.parametrize("page_size", [1, 5, 17, 32, 48])
def test_cuda_decode_any_page_size(page_size):
    """Pages of a multiple of 16 tokens hold whole tiles (one block-table entry per tile); others take rows per
    token."""
    lengths = [1, page_size - 1 or 2, page_size, page_size + 1, 333]
    store, meta = paged_store(lengths, page_size, 2, 128, "turbo3", "turbo4", seed=page_size)
    q = torch.randn(len(lengths), 6, 128, generator=torch.Generator().manual_seed(1))
    want = attention_over_decoded_pages(q.half().double().float(), store.k, store.v, "turbo3", "turbo4", meta,
                                        128**-0.5).double()
    for splits in (1, 4):
        got, _ = cuda_decode(store, meta, q, splits=splits, triton=False, int8_keys=False)
        assert_close(got, want, 3e-3, f"page {page_size}, {splits} splits, vs decode-then-attend")


def offset_oracle(store, meta, q64, int8_keys):
    """Float64 attention over the represented keys (decoded pages + o(p)), as the fp16 or int8-keys build defines it."""
    keys = represented_keys(store, meta.block_tables, meta.seq_lens_cpu)
    if int8_keys:
        return int8_keys_oracle(q64, store, meta, store.head_dim**-0.5, keys)
    return attention64(q64, keys, decode64(store.v, store.head_dim), meta, store.head_dim**-0.5)


@needs_gpu
@pytest.mark.parametrize("int8_keys", [False, True], ids=["fp16_keys", "int8_keys"])
@pytest.mark.parametrize(
    "head_dim,gqa,k_kind,v_kind,theta,turned_pairs",
    [(128, 4, "turbo3", "turbo3", 500000.0, 8), (128, 2, "turbo4", "turbo3", 10000.0, 1),
     (64, 3, "turbo3", "turbo2", 500000.0, 12), (128, 8, "turbo2", "turbo3", 10000.0, None),
     (256, 2, "turbo3", "turbo4", 10000.0, 5), (64, 1, "turbo4", "turbo4", 500000.0, None)],
)
def test_cuda_decode_with_key_offset_matches_float64(head_dim, gqa, k_kind, v_kind, theta, turned_pairs,
                                                     int8_keys):
    """Partial offsets (1, 5, 8 pairs: one pair tile; 12: two) and turned ones (all D/2 pairs); position 0 (the
    sink) in the first of 1-5 splits; the oracle adds o(p) to the decoded keys in float64."""
    store, meta, q, _ = decode_case([1, 2, 15, 16, 17, 300], 2, gqa, head_dim, k_kind, v_kind, theta,
                                    seed=head_dim + gqa, turned_pairs=turned_pairs)
    want = offset_oracle(store, meta, q.half().double(), int8_keys)
    for splits in (1, 2, 5):
        got, triton = cuda_decode(store, meta, q, splits=splits, int8_keys=int8_keys,
                                  triton=turned_pairs in (8, None) and gqa > 1 and not int8_keys)
        assert_close(got, want, 3e-3, f"CUDA decode with offset, {splits} splits, vs float64")
        if triton is not None:
            assert_close(got, triton, 3e-3, f"CUDA decode with offset, {splits} splits, vs Triton")


@needs_gpu
def test_cuda_decode_replays_in_a_cuda_graph_at_other_lengths():
    """Captured once (the engine captures decode), replayed after the lengths change in place: the same as eager,
    and a seq_len-0 padding row comes out zero."""
    store, meta, q = scenario([1000, 45, 3], [1, 1, 1], 2, 4, 128, "turbo3", "turbo3", seed=7)
    k, v, _, meta, q, signs = on_gpu(store, meta, q, torch.float16)
    hinted = AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.seq_lens.clone(), meta.query_start_loc,
                               [1000] * 3, [1] * 3)

    def decode():
        return attention_cuda.decode_attention_cuda(q, k, v, hinted, 128**-0.5, signs, store.inv_sqrt)

    decode()  # compiles, and warms the caches a capture only reads
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode()
    hinted.seq_lens.copy_(torch.tensor([700, 0, 3], dtype=torch.int32))
    graph.replay()
    eager_meta = AttentionMetadata(meta.slot_mapping, meta.block_tables, hinted.seq_lens, meta.query_start_loc,
                                   [700, 0, 3], [1] * 3)
    eager = attention_cuda.decode_attention_cuda(q, k, v, eager_meta, 128**-0.5, signs, store.inv_sqrt)
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "graph replay differs from eager at the new lengths"
    assert out[1].eq(0).all(), "a seq_len-0 row must come out zero"


@needs_gpu
def test_unsupported_calls_fall_back_and_the_store_dispatches(monkeypatch):
    """fp32 queries, more than 8 query heads per KV head, or TURBOSERVE_CUDA_KERNELS=0: None (Triton serves).
    TurboKVStore.attend's decode step takes the CUDA kernel where it runs and the call has CUDA_DECODE_MIN_WORK,
    the Triton kernel below it."""
    store, meta, q = scenario([40, 3], [1, 1], 1, 16, 64, "turbo3", "turbo3", seed=9)
    k, v, _, gmeta, gq, signs = on_gpu(store, meta, q, torch.float16)
    args = (k, v, gmeta, 0.125, signs, store.inv_sqrt)
    assert attention_cuda.decode_attention_cuda(gq, *args) is None, "GQA 16 must fall back"
    assert attention_cuda.decode_attention_cuda(gq[:, :8].float(), *args) is None, "fp32 queries must fall back"
    monkeypatch.setenv("TURBOSERVE_CUDA_KERNELS", "0")
    assert attention_cuda.decode_attention_cuda(gq[:, :8].contiguous(), *args) is None, "the switch must turn it off"
    monkeypatch.delenv("TURBOSERVE_CUDA_KERNELS")

    store, meta, q = scenario([40, 3], [1, 1], 2, 4, 64, "turbo3", "turbo4", seed=10)
    gpu_store = TurboKVStore(1, 16, 2, 64, "turbo3", "turbo4", GPU, torch.float16)
    gpu_store._k, gpu_store._v, _, gmeta, gq, _ = on_gpu(store, meta, q, torch.float16)  # k, v: read-only views
    calls = []
    real = store_module.decode_attention_cuda
    monkeypatch.setattr(store_module, "decode_attention_cuda", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert 2 * 2 * 40 < store_module.CUDA_DECODE_MIN_WORK
    got = gpu_store.attend(gq, gmeta, 0.125).double().cpu()
    assert calls == [], "a decode step this small must take the Triton kernel"
    assert_close(got, oracle(q.half().double(), store, meta, 0.125), 3e-3, "store.attend's Triton decode vs float64")
    monkeypatch.setattr(store_module, "CUDA_DECODE_MIN_WORK", 2 * 2 * 40)
    got = gpu_store.attend(gq, gmeta, 0.125).double().cpu()
    assert calls == [1], "the decode step did not take the CUDA kernel"
    want = (int8_keys_oracle if attention_cuda.INT8_KEYS else oracle)(q.half().double(), store, meta, 0.125)
    assert_close(got, want, 3e-3, "store.attend decode vs float64 (the default build's definition)")


@pytest.mark.parametrize("batch,context,splits", [(8, 65536, 4), (8, 16384, 4), (1, 65536, 33), (32, 4096, 1)])
def test_split_rule_fills_one_wave_of_ctas(monkeypatch, batch, context, splits):
    """One wave of 8-warp CTAs (2 per SM at 128 registers) on 132 SMs; b8 at 64K and 16K: the measured best
    (4 splits beat 8 at both, H200, bench/turbo_decode_sweep.py)."""
    monkeypatch.setattr(attention_cuda, "multiprocessors", lambda device: 132)
    assert attention_cuda.choose_splits(batch, 8, context, GPU) == splits


def test_cta_width_fits_static_shared_memory():
    """8-warp CTAs except at D = 256, where their outputs (64 KB) exceed the 48 KB a launch gets without opt-in."""
    assert [attention_cuda.default_warps(d, 1) for d in (64, 128, 256)] == [8, 8, 4]
    assert attention_cuda.default_warps(128, 8) == 8  # a turned offset's terms share the space
    for head_dim in (64, 128, 256):
        assert attention_cuda._shared_bytes(head_dim, 16, attention_cuda.default_warps(head_dim, 16)) <= 48 * 1024


def prmt(a, b, selector):
    """PTX prmt.b32, default mode: byte k = byte (nibble k & 7) of {b, a}, its sign replicated if nibble k & 8."""
    out = 0
    for k in range(4):
        nibble = (selector >> 4 * k) & 15
        byte = ((a | b << 32) >> 8 * (nibble & 7)) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * k
    return out


def lookup_s8(selector, table, bits):
    """The kernel's lookup_s8 sequence: (values 0-3, values 4-7) of a nibble selector as int8 bytes."""
    if bits == 4:
        w4, s7 = selector << 4 & 0xFFFFFFFF, selector & 0x77777777
        m0, m1 = prmt(w4, selector, 0xD9C8), prmt(w4, selector, 0xFBEA)
        lo = prmt(table[0], table[1], s7) & ~m0 | prmt(table[2], table[3], s7) & m0
        return lo, prmt(table[0], table[1], s7 >> 16) & ~m1 | prmt(table[2], table[3], s7 >> 16) & m1
    return prmt(table[0], table[1], selector), prmt(table[0], table[1], selector >> 16)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [64, 128])
def test_int8_tables_decode_every_code_at_every_position(bits, group):
    """Every index in every nibble of a selector comes out as its int8 centroid in that byte; the int8 centroids
    are int8, symmetric as the codebook, and represent it at least as well as the plain rounding at +-127 and
    within 1 % of the best least-squares fit over any integer largest value 64..127."""
    centroids, unit = attention_cuda.int8_centroids(bits, group)
    exact = torch.tensor(codebook(bits, group).centroids, dtype=torch.float64)
    assert max(abs(c) for c in centroids) <= 127 and centroids == tuple(-c for c in reversed(centroids))
    error = (torch.tensor(centroids, dtype=torch.float64) * unit - exact).pow(2).sum().item()

    def least_squares(largest):
        n = torch.round(exact * largest / exact.abs().max())
        return (n * (n @ exact) / (n @ n) - exact).pow(2).sum().item()

    plain = exact.abs().max() / 127
    assert error <= (torch.round(exact / plain) * plain - exact).pow(2).sum().item()
    assert error <= 1.01 * min(least_squares(m) for m in range(64, 128))
    table = attention_cuda.int8_table_words(bits, group)
    codes = 1 << bits
    for index in range(codes):
        for position in range(8):
            nibbles = [(index + 3 * (position - k)) % codes for k in range(8)]  # neighbours hold other codes
            nibbles[position] = index
            lo, hi = lookup_s8(sum(n << 4 * k for k, n in enumerate(nibbles)), table, bits)
            got = [((lo | hi << 32) >> 8 * k & 0xFF) for k in range(8)]
            assert [b - 256 if b > 127 else b for b in got] == [centroids[n] for n in nibbles], (index, position)


@pytest.mark.parametrize("kind", ["turbo2", "turbo3", "turbo4"])
def test_int8_key_scores_error_follows_the_rounding_analysis(kind):
    """The int8 build's logit error (attention_cuda docstring) is what rounding predicts, and far below turbo's own.

    Per group, score error = n (e . c8 + q' . eps): e the query's rounding error (uniform in +-step/2, step =
    max |q'| / 127, so variance step^2 / 12 per dim, independent of the keys) and eps = c8 - c the centroids' fixed
    rounding, a zero-mean error over the symmetric codebook's indices. So the predicted variance is
    n^2 (step^2 / 12 ||c8||^2 + sum_d q'_d^2 E[eps^2]); measured within 20 % of it. That error is >= 10x below the
    logit error turbo's quantization itself makes (vs the unquantized keys; measured 50x turbo2, 28x turbo3, 13x
    turbo4 at D = 128)."""
    gen = torch.Generator().manual_seed(0)
    bits, head_dim = {"turbo2": 2, "turbo3": 3, "turbo4": 4}[kind], 128
    keys = torch.randn(4096, head_dim, generator=gen, dtype=torch.float64) * 2 + 0.5
    q = torch.randn(32, head_dim, generator=gen, dtype=torch.float64)
    codes, norms = quantize_reference(keys.float(), kind)
    idx, n = unpack_indices(codes, bits, head_dim).long(), norms.double()[:, 0]
    c8, unit = attention_cuda.int8_centroids(bits, head_dim)
    c8 = torch.tensor(c8, dtype=torch.float64) * unit
    c = torch.tensor(codebook(bits, head_dim).centroids, dtype=torch.float64)
    rotated = q @ rotation_matrix64(head_dim).T
    step = rotated.abs().amax(-1, keepdim=True) / 127
    exact = rotated @ (c[idx] * n[:, None]).T
    int8 = int8_query(rotated) @ (c8[idx] * n[:, None]).T
    measured = (int8 - exact).pow(2).mean().sqrt().item()
    eps2 = (c8 - c)[idx].pow(2).mean()
    predicted = (n.pow(2)[None] * (step.pow(2) / 12 * c8[idx].pow(2).sum(-1)[None]
                                   + rotated.pow(2).sum(-1, keepdim=True) * eps2)).mean().sqrt().item()
    assert 0.8 < measured / predicted < 1.25, f"measured rms {measured:.4g} vs predicted {predicted:.4g}"
    turbo = (q @ keys.T - exact).pow(2).mean().sqrt().item()
    assert turbo > 10 * measured, f"turbo's own logit error {turbo:.4g} vs int8's {measured:.4g}"


# ---- the recent window (recent.py): the last W positions from the ring, the rest from the pages ----


def recent_case(seq_lens, size, kv_heads, gqa, head_dim, k_kind, v_kind, dtype, page_size=16, turned_pairs=0,
                seed=0):
    """(store, ring, decode metadata, queries): keys like real ones (rope_keys) in shuffled pages, each sequence's
    last ``size`` positions also in its ring row (shuffled rows; recent_values, in ``dtype``), the rows' unused
    slots NaN and the pages' norms of the ring's positions 2^14 (reading either shows); ``turned_pairs``: 0 no key
    offset, None all pairs turned, P partial on P pairs. ``q`` float32 (the kernel's dtype rounds it)."""
    gen = torch.Generator().manual_seed(seed)
    offset = offset_for(kv_heads, head_dim, 10000.0, seed, None if turned_pairs is None else turned_pairs or 1)
    tables, num_pages = shuffled_tables(seq_lens, page_size, gen)
    store = TurboKVStore(num_pages, page_size, kv_heads, head_dim, k_kind, v_kind, "cpu", torch.float32)
    if turned_pairs != 0:
        store.set_key_offset(offset)
    key_offset = store.key_offset if store.offset_turns else None
    ring = RecentWindow.empty(len(seq_lens) + 2, size, kv_heads, head_dim, dtype, "cpu")
    ring.k.fill_(float("nan"))
    ring.v.fill_(float("nan"))
    rows = torch.randperm(len(seq_lens) + 2, generator=gen)[: len(seq_lens)].to(torch.int32)
    for s, n in enumerate(seq_lens):
        k, positions = rope_keys(n, kv_heads, head_dim, offset, gen)
        v = torch.randn(n, kv_heads, head_dim, generator=gen)
        slots = slots_of(tables[s], positions, page_size)
        store.write(k, v, slots, positions)
        near = positions[max(0, n - size):]
        ring.k[rows[s], near % size] = recent_values(k[near], near, key_offset, dtype)
        ring.v[rows[s], near % size] = recent_values(v[near], near, None, dtype)
        for pages in (store.k, store.v):
            pages.norms[slots[near] // page_size, :, slots[near] % page_size] = 2.0**14
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), tables, torch.tensor(seq_lens, dtype=torch.int32),
                             torch.arange(len(seq_lens) + 1, dtype=torch.int32), list(seq_lens), [1] * len(seq_lens),
                             rows)
    q = torch.randn(len(seq_lens), kv_heads * gqa, head_dim, generator=gen)
    return store, ring, meta, q


def recent_oracle(q64, store, ring, meta, scale):
    """test_recent_decode.window_oracle64 reading the ring: its rows rotated back with the explicit matrix, plus o(j)."""
    group = group_size(store.head_dim)
    r = rotation_matrix64(group)

    def exact(s, j):
        row = int(meta.recent_rows[s])
        back = [(x[row, j % ring.size].double().reshape(len(j), -1, group) @ r).reshape(len(j), *x.shape[2:])
                for x in (ring.k, ring.v)]
        if store.key_offset is not None:
            back[0] = back[0] + offset64(store.key_offset, j)
        return back

    return window_oracle64(q64, store, meta, ring.size, scale, exact)


def recent_on_gpu(ring, gpu_meta, rows):
    """The ring on the GPU, and the GPU metadata (on_gpu's) with the ring ``rows``."""
    return RecentWindow(ring.k.to(GPU), ring.v.to(GPU)), dataclasses.replace(gpu_meta, recent_rows=rows.to(GPU))


def float32_reference(q, store, ring, meta, scale):
    """recent.attention_with_recent_reference (the window's definition) on the CPU store; rows of seq_len 0 (no
    query there) zero. The step's own rows: the ring's, as a decode step writes its token before attending."""
    live = [n > 0 for n in meta.seq_lens_cpu]
    step_k = torch.stack([ring.k[int(r), (n - 1) % ring.size] for r, n in zip(meta.recent_rows, meta.seq_lens_cpu)])
    step_v = torch.stack([ring.v[int(r), (n - 1) % ring.size] for r, n in zip(meta.recent_rows, meta.seq_lens_cpu)])
    keep = torch.tensor(live)
    live_meta = AttentionMetadata(meta.slot_mapping, meta.block_tables[keep], meta.seq_lens[keep],
                                  torch.arange(sum(live) + 1, dtype=torch.int32),
                                  [n for n in meta.seq_lens_cpu if n], [1] * sum(live), meta.recent_rows[keep])
    out = torch.zeros(q.shape, dtype=torch.float64)
    out[keep] = attention_with_recent_reference(
        q[keep], store.k, store.v, store.k_kind, store.v_kind, ring, step_k[keep], step_v[keep], live_meta, scale,
        store.key_offset if store.offset_turns else None).double()
    return out


def window_lengths(size):
    """A padding row, one and two tokens, around the window's edge, and many tiles (several splits)."""
    return sorted({0, 1, 2, max(size - 1, 1), size, size + 1, 1000})


@needs_gpu
@pytest.mark.parametrize(
    "head_dim,gqa,k_kind,v_kind,size,turned_pairs,dtype,page_size",
    [(64, 1, "turbo3", "turbo3", 1, 0, torch.float16, 16), (64, 8, "turbo2", "turbo4", 5, 5, torch.float16, 16),
     (128, 4, "turbo3", "turbo3", 128, 8, torch.bfloat16, 16),
     (128, 2, "turbo4", "turbo3", 16, None, torch.float16, 16),
     (128, 3, "turbo3", "turbo2", 17, 0, torch.bfloat16, 5), (128, 8, "turbo2", "turbo2", 128, 0, torch.float16, 32),
     (256, 4, "turbo4", "turbo2", 17, 8, torch.float16, 16), (256, 1, "turbo3", "turbo3", 5, 0, torch.bfloat16, 16),
     (64, 5, "turbo4", "turbo4", 16, None, torch.float16, 17), (128, 6, "turbo3", "turbo4", 1, 1, torch.float16, 16),
     (128, 7, "turbo4", "turbo4", 128, 12, torch.float16, 48)],
)
def test_cuda_decode_with_recent_window_matches_float64(head_dim, gqa, k_kind, v_kind, size, turned_pairs, dtype,
                                                        page_size):
    """W = 1, 5, 16, 17, 128 (ring edges mid-tile and on tile boundaries), lengths 0 (padding), 1, 2, W - 1, W,
    W + 1, 1000; 1, 3, 9 splits (at 9, 128-token splits: W = 128's edge falls in one split and the window spans
    the next) and the rule; no / partial (1, 5, 8, 12 pairs) / turned key offsets; fp16 and bf16 queries and
    rings; page sizes with and without whole tiles. fp16: Q's and P's rounding (3e-3 of the output's scale, as the
    pages); bf16: its output rounding (1.5e-2)."""
    lengths = window_lengths(size)
    store, ring, meta, q = recent_case(lengths, size, 2, gqa, head_dim, k_kind, v_kind, dtype, page_size,
                                       turned_pairs, seed=head_dim + gqa + size)
    scale = head_dim**-0.5
    q64 = q.to(dtype).double()
    want = recent_oracle(q64, store, ring, meta, scale)
    reference = float32_reference(q.to(dtype).float(), store, ring, meta, scale)
    tol = 3e-3 if dtype == torch.float16 else 1.5e-2
    assert_close(reference, want, 1e-4, "attention_with_recent_reference vs the float64 oracle")
    k, v, offset, gmeta, gq, signs = on_gpu(store, meta, q, dtype)
    gring, gmeta = recent_on_gpu(ring, gmeta, meta.recent_rows)
    for splits in (1, 3, 9, None):
        out = attention_cuda.decode_attention_cuda(gq, k, v, gmeta, scale, signs, store.inv_sqrt, offset,
                                                   num_splits=splits, recent=gring)
        assert out is not None, "the CUDA kernel refused a supported call with a recent window"
        assert not attention_cuda._COUNTERS[gq.device].any(), "the last CTA of a row must leave its split counter at 0"
        got = out.double().cpu()
        assert torch.isfinite(got).all(), f"{splits} splits: non-finite output (a NaN ring slot or poisoned page read)"
        assert got[lengths.index(0)].eq(0).all(), "a seq_len-0 row must come out zero"
        assert_close(got, want, tol, f"CUDA decode with W={size}, {splits} splits, vs float64")
        assert_close(got, reference, tol, f"CUDA decode with W={size}, {splits} splits, vs the float32 reference")


@needs_gpu
def test_cuda_decode_with_recent_window_replays_in_a_cuda_graph_at_other_lengths():
    """Captured once, replayed after the lengths and ring rows change in place: the same as eager, and as the
    oracle; a row that became seq_len 0 comes out zero."""
    store, ring, meta, q = recent_case([1000, 45, 3], 32, 2, 4, 128, "turbo3", "turbo3", torch.bfloat16,
                                       turned_pairs=8, seed=11)
    k, v, offset, gmeta, gq, signs = on_gpu(store, meta, q, torch.bfloat16)
    gring, meta = recent_on_gpu(ring, gmeta, meta.recent_rows)
    hinted = dataclasses.replace(meta, seq_lens=meta.seq_lens.clone(), recent_rows=meta.recent_rows.clone(),
                                 seq_lens_cpu=[1000] * 3)

    def decode():
        return attention_cuda.decode_attention_cuda(gq, k, v, hinted, 128**-0.5, signs, store.inv_sqrt, offset,
                                                    recent=gring)

    decode()  # compiles, and warms the caches a capture only reads
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode()
    lengths, rows = [700, 0, 3], [int(r) for r in meta.recent_rows]
    hinted.seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
    # sequence 0 now 700 long: its ring must hold positions 668..699 (as the runtime's writes would leave it)
    positions = torch.arange(700 - 32, 700)
    gen = torch.Generator().manual_seed(12)
    ring.k[rows[0], positions % 32] = torch.randn(32, 2, 128, generator=gen).bfloat16()
    ring.v[rows[0], positions % 32] = torch.randn(32, 2, 128, generator=gen).bfloat16()
    gring.k.copy_(ring.k)
    gring.v.copy_(ring.v)
    graph.replay()
    eager_meta = dataclasses.replace(hinted, seq_lens_cpu=lengths)
    eager = attention_cuda.decode_attention_cuda(gq, k, v, eager_meta, 128**-0.5, signs, store.inv_sqrt, offset,
                                                 recent=gring)
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "graph replay differs from eager at the new lengths"
    assert out[1].eq(0).all(), "a seq_len-0 row must come out zero"
    cpu_meta = dataclasses.replace(eager_meta, block_tables=eager_meta.block_tables.cpu(),
                                   recent_rows=eager_meta.recent_rows.cpu())
    want = recent_oracle(q.bfloat16().double(), store, ring, cpu_meta, 128**-0.5)
    assert_close(out.double().cpu(), want, 1.5e-2, "graph replay with a recent window vs float64")


@needs_gpu
def test_recent_window_calls_the_kernel_cannot_take_fall_back():
    """The int8-keys build (asked for explicitly) and a ring of another dtype than the queries: None (Triton
    serves)."""
    store, ring, meta, q = recent_case([40, 3], 8, 2, 4, 64, "turbo3", "turbo3", torch.float16, seed=13)
    k, v, _, gmeta, gq, signs = on_gpu(store, meta, q, torch.float16)
    gring, gmeta = recent_on_gpu(ring, gmeta, meta.recent_rows)
    args = (gq, k, v, gmeta, 0.125, signs, store.inv_sqrt)
    assert attention_cuda.decode_attention_cuda(*args, int8_keys=True, recent=gring) is None
    other = RecentWindow(gring.k.bfloat16(), gring.v.bfloat16())
    assert attention_cuda.decode_attention_cuda(*args, recent=other) is None, "a bf16 ring with fp16 queries"


def test_recent_window_without_its_rows_is_explained():
    """A window with no ring rows in the metadata, or rows not [num_seqs] int32: a clear error on any device (a
    wiring bug, not a case for the Triton fallback)."""
    store, ring, meta, q = recent_case([40, 3], 8, 2, 4, 64, "turbo3", "turbo3", torch.float16, seed=13)
    for rows in (None, meta.recent_rows.long(), meta.recent_rows[:1]):
        with pytest.raises(ValueError, match=r"recent_rows, each sequence's ring row as \[2\] int32"):
            bad = dataclasses.replace(meta, recent_rows=rows)
            attention_cuda.decode_attention_cuda(q.half(), store.k, store.v, bad, 0.125, store.signs, store.inv_sqrt,
                                                 recent=ring)
