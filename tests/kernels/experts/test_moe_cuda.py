"""The tensor-core CUDA C decode body of e8p / e8p3 experts (moe_cuda.py) against the codebook definition and a
float64 oracle. Its table layout is checked everywhere; the kernel itself only where CUDA runs (it is compiled by
NVRTC at run time), exhaustively over every code."""

import math

import pytest
import torch

from server.kernels.experts import e8p, moe, moe_cuda, moe_cuda_int8, weights
from server.kernels.experts.weights import ExpertWeights
from tests.kernels.experts.test_fused_moe import _problem, oracle

DTYPES = [torch.float16, torch.bfloat16]


def _halves_as_float(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 16-bit patterns -> their fp16 / bf16 values as float32."""
    return bits.to(torch.int16).view(dtype).float()


def _pairs_read_like_the_kernel(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 nibble words [n] -> [n, 8] float32 values 1 + n_k/16 of the A registers `pairs` builds: register j
    is ror(word, 4j) & mask | one, its low half coordinate 2j, its high half 2j + 1."""
    _, mask, one = moe_cuda._FIELD[dtype]
    out = []
    for j in range(4):
        r = ((words >> 4 * j) | (words << (32 - 4 * j))) & 0xFFFFFFFF if j else words
        reg = (r & mask) | one
        out += [_halves_as_float(reg & 0xFFFF, dtype), _halves_as_float(reg >> 16, dtype)]
    return torch.stack(out, -1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_tables_decode_every_code_and_residual_code_as_the_spec_defines(dtype):
    """ABS[a] ^ SIGN[s], read into A registers as the kernel reads them, gives 8·A - 11.75 = the spec's point for
    all 65,536 codes; RES gives 8·A - 10 = the residual point (times 2.04) for all 256 residual codes."""
    table = moe_cuda.kernel_tables_cpu(dtype).long() & 0xFFFFFFFF
    codes = torch.arange(1 << 16)
    values = _pairs_read_like_the_kernel(table[codes >> 8] ^ table[256 + (codes & 0xFF)], dtype)
    assert torch.equal(8 * values - 11.75, e8p.decode(codes))
    residual = _pairs_read_like_the_kernel(table[512 + torch.arange(256)], dtype)
    assert torch.equal(8 * residual - 10, e8p.residual_table())


def test_shapes_the_cuda_body_cannot_take_are_refused():
    x = torch.zeros(2, 128, dtype=torch.float16)
    w = weights.quantize(torch.randn(1, 16, 128), "e8p")
    assert not moe_cuda.supports(x, w)  # not on a GPU
    assert moe_cuda.expert_kernel(x, w, dual=False) is None


# ---- on the GPU ----------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu  # the CUDA C body needs an NVIDIA GPU (NVRTC compiles it there): tests/conftest.py skips it elsewhere


def _kernel_or_skip(a, w, dual):
    kernel = moe_cuda.expert_kernel(a, w, dual)
    if kernel is None:
        pytest.skip("NVRTC did not provide the kernel on this host (see the log), so the Triton body serves")
    return kernel


def _down_launch(w: ExpertWeights, a: torch.Tensor, ids: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
    """One non-dual launch: out[p] = routing[p] · W[ids[p]] a[p], poisoned first so unwritten rows show."""
    kernel = _kernel_or_skip(a, w, dual=False)
    out = torch.full((a.shape[0], w.shape[1]), float("nan"), dtype=torch.float32, device="cuda")
    moe_cuda.launch_expert_cuda(kernel, a, out, ids.to(torch.int32).cuda(), w, routing=routing.float().cuda())
    return out.cpu()


def _unit_weights(fmt: str, codes: torch.Tensor, residual: torch.Tensor | None = None) -> ExpertWeights:
    """One expert [N, K] of the given codes with scale 1."""
    n, k = codes.shape[0], codes.shape[1] * 8
    t = {"codes": codes[None].cuda(), "scale": torch.ones((1, n), dtype=torch.float16, device="cuda")}
    if residual is not None:
        t["residual"] = residual[None].cuda()
    return ExpertWeights(fmt, (1, n, k), t)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_e8p_code_decodes_through_the_kernel_to_its_codebook_point(dtype):
    """Rows of 8 codes, all 65,536 codes; activation p is the unit vector e_p, so out[p, n] is weight (n, p)."""
    codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).reshape(8192, 8)
    w = _unit_weights("e8p", codes)
    eye = torch.eye(64, dtype=dtype, device="cuda")
    got = _down_launch(w, eye, torch.zeros(64), torch.ones(64)).T
    assert torch.equal(got, e8p.decode(codes).reshape(8192, 64)), "a code decodes wrongly in the CUDA body"


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_residual_code_decodes_through_the_kernel(dtype):
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(-(1 << 15), 1 << 15, (32, 8), generator=gen, dtype=torch.int32).to(torch.int16)
    residual = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(32, 8)
    w = _unit_weights("e8p3", codes, residual)
    got = _down_launch(w, torch.eye(64, dtype=dtype, device="cuda"), torch.zeros(64), torch.ones(64)).T
    want = (e8p.decode(codes) + e8p.decode_residual(residual)).reshape(32, 64)
    assert (got - want).abs().max() < 1e-6, "a residual code decodes wrongly in the CUDA body"


def _random_weights(fmt, num_e, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return weights.quantize(torch.randn(num_e, n, k, generator=gen) / math.sqrt(k), fmt, seed=seed).to("cuda")


def down_problem(fmt, num_e, n, k, dtype):
    """(weights on the GPU, activations [9, K] of ``dtype``, expert ids with pair 1 on pair 0's expert and the last
    expert without pairs, routing weights) for one down launch."""
    gen = torch.Generator().manual_seed(1)
    pairs = 9
    a = torch.randn(pairs, k, generator=gen).to(dtype)
    ids = torch.randint(0, num_e - 1, (pairs,), generator=gen)
    ids[1] = ids[0]
    return _random_weights(fmt, num_e, n, k, seed=n + k), a, ids, torch.rand(pairs, generator=gen)


# (format, experts, rows N, inputs K): K not a multiple of the 256-input step (one partial step) and odd N.
LAUNCH_CASES = [("e8p", 5, 37, 320), ("e8p3", 3, 70, 192), ("e8p", 2, 16, 1088)]


@gpu
@pytest.mark.parametrize("fmt,num_e,n,k", LAUNCH_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_down_launch_matches_float64(fmt, num_e, n, k, dtype):
    w, a, ids, routing = down_problem(fmt, num_e, n, k, dtype)
    got = _down_launch(w, a.cuda(), ids, routing).double()
    dense = w.dequantize(dtype=torch.float64).cpu()
    want = routing.double()[:, None] * torch.einsum("pnk,pk->pn", dense[ids], a.double())
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-4, f"CUDA down launch differs from float64 (max error {err:.1e} of the largest output)"


@gpu
@pytest.mark.parametrize("fmt,num_e,n,k", LAUNCH_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_launch_matches_float64(fmt, num_e, n, k, dtype):
    w = _random_weights(fmt, num_e, 2 * n, k, seed=2 * n + k)
    gen = torch.Generator().manual_seed(2)
    tokens, top_k = 3, 2
    a = torch.randn(tokens, k, generator=gen).to(dtype)
    ids = torch.randint(0, num_e, (tokens * top_k,), generator=gen)
    kernel = _kernel_or_skip(a.cuda(), w, dual=True)
    h = torch.full((tokens * top_k, n), float("nan"), dtype=dtype, device="cuda")
    moe_cuda.launch_expert_cuda(kernel, a.cuda(), h, ids.to(torch.int32).cuda(), w, dual=True, a_row_div=top_k)
    dense = w.dequantize(dtype=torch.float64).cpu()
    g = torch.einsum("pnk,pk->pn", dense[ids], a.double().repeat_interleave(top_k, 0))
    want = torch.nn.functional.silu(g[:, :n]) * g[:, n:]
    err = (h.cpu().double() - want).abs()
    ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)  # h is rounded to the activation dtype
    worst = (err - ulp * want.abs()).max().item() / want.abs().max().item()
    assert worst < 1e-4, f"CUDA gate_up launch differs from float64 beyond rounding h ({worst:.1e} of the largest)"


# (format, experts, D, I, tokens, top_k): odd expert counts, widths with a partial K step.
OP_CASES = [("e8p", 5, 320, 192, 1, 3), ("e8p", 5, 320, 192, 8, 3), ("e8p3", 3, 192, 320, 1, 2),
            ("e8p3", 3, 192, 320, 8, 2)]


@gpu
@pytest.mark.parametrize("fmt,num_e,d,i,tokens,top_k", OP_CASES)
def test_fused_op_through_the_cuda_body_matches_float64_oracle(fmt, num_e, d, i, tokens, top_k, monkeypatch):
    """The dispatched op (both launches on the CUDA body: counted) at T = 1 and 8, a token routed twice to one
    expert and an expert without tokens (_problem)."""
    x, w, ids, gu, dn = _problem(fmt, num_e, d, i, tokens, top_k, seed=d + i + tokens)
    gu, dn = gu.to("cuda"), dn.to("cuda")
    calls = []
    launch = moe_cuda.launch_expert_cuda
    monkeypatch.setattr(moe_cuda, "launch_expert_cuda", lambda *a, **k: calls.append(1) or launch(*a, **k))
    xh = x.half()
    got = moe.fused_moe_triton(xh.cuda(), w.cuda(), ids.cuda(), gu, dn, gemv=True).double().cpu()
    if not calls:
        pytest.skip("NVRTC did not provide the kernel on this host, so the Triton body served")
    assert len(calls) == 2
    want = oracle(xh.float(), w, ids, gu.to("cpu"), dn.to("cpu"))
    err = ((got - want).norm() / want.norm()).item()
    assert err < 2e-3, f"CUDA-body op differs from the float64 oracle (relative error {err:.1e})"


@gpu
@pytest.mark.parametrize("fmt", ["e8p", "e8p3"])
@pytest.mark.parametrize("int8", [False, True])
def test_cuda_bodies_read_every_code_they_are_given(fmt, int8):
    """Flipping one bit of one code of expert 0's gate_up, then down (then the residual for e8p3), changes y: the
    float body, and the integer one on int8 activations."""
    x, w, ids, gu, dn = _problem(fmt, 2, 256, 256, tokens=2, top_k=1, seed=4)
    x, w, ids, gu, dn = x.half().cuda(), w.cuda(), ids.cuda(), gu.to("cuda"), dn.to("cuda")
    ids[:] = 0
    if (moe_cuda_int8.expert_kernel(gu, True, x.dtype) if int8 else moe_cuda.expert_kernel(x, gu, True)) is None:
        pytest.skip("NVRTC did not provide the kernel on this host (see the log)")
    before = moe.fused_moe_triton(x, w, ids, gu, dn, gemv=True, int8_activations=int8)
    keys = [(gu, "codes"), (dn, "codes")] + ([(dn, "residual")] if fmt == "e8p3" else [])
    for proj, key in keys:
        saved = proj.tensors[key].clone()
        proj.tensors[key].view(torch.uint8).reshape(-1)[5] ^= 0x10
        after = moe.fused_moe_triton(x, w, ids, gu, dn, gemv=True, int8_activations=int8)
        assert not torch.equal(before, after), f"{fmt}: a flipped {key} bit left the CUDA-body output unchanged"
        proj.tensors[key].copy_(saved)


@gpu
def test_cuda_kernels_switched_off_keep_the_triton_body(monkeypatch):
    x, w, ids, gu, dn = _problem("e8p", 3, 128, 64, tokens=1, top_k=2, seed=6)
    monkeypatch.setenv("TURBOSERVE_CUDA_KERNELS", "0")
    calls = []
    monkeypatch.setattr(moe, "launch_expert_gemv", lambda *a, **k: calls.append("gemv"))
    monkeypatch.setattr(moe_cuda, "launch_expert_cuda", lambda *a, **k: calls.append("cuda"))
    moe.fused_moe_triton(x.half().cuda(), w.cuda(), ids.cuda(), gu.to("cuda"), dn.to("cuda"), gemv=True)
    assert calls == ["gemv", "gemv"]
