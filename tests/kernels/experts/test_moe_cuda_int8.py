"""The integer-MMA decode body of e8p / e8p3 experts (moe_cuda_int8.py) and its activation rows
(int8_activations.quantize_rows_*): the table words and the rows everywhere, the kernel where CUDA runs,
exhaustively over every code, against a float64 oracle on the int8-rounded activations."""

import pytest
import torch

from server.kernels.experts import e8p, moe, moe_cuda, moe_cuda_int8, moe_reference, weights
from server.kernels.experts import int8_activations as act8
from server.kernels.experts.weights import ExpertWeights
from server.kernels.experts.moe_reference import fused_moe_reference
from tests.kernels.experts.test_fused_moe import _problem
from tests.kernels.experts.test_moe_cuda import _random_weights, down_problem


def _operands(words: torch.Tensor) -> torch.Tensor:
    """int64 table words [n] -> [n, 8] the weights the kernel multiplies: the u8 bytes of word & 0x0F0F0F0F
    (coordinates 0-3) and of word & 0xF0F0F0F0 divided by 16 (coordinates 4-7), as n_k."""
    low, high = words & 0x0F0F0F0F, words & 0xF0F0F0F0
    return torch.stack([(low >> 8 * b) & 0xFF for b in range(4)] + [((high >> 8 * b) & 0xFF) // 16 for b in range(4)],
                       -1).double()


def test_int8_tables_give_every_code_and_residual_code_as_the_spec_defines():
    """ABS[a] ^ SIGN[s] split into the two MMA operands gives (2n - 15)/4 = the spec's point for all 65,536 codes;
    RES gives (m - 4)/2 = the residual point (times 2.04) for all 256 residual codes."""
    table = moe_cuda_int8.kernel_tables_cpu().long() & 0xFFFFFFFF
    codes = torch.arange(1 << 16)
    n = _operands(table[codes >> 8] ^ table[256 + (codes & 0xFF)])
    assert torch.equal((2 * n - 15) / 4, e8p.decode(codes).double())
    m = _operands(table[512:])
    assert torch.equal((m - 4) / 2, e8p.residual_table().double())


@pytest.mark.parametrize("group", [0, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rows_in_one_launch_match_the_torch_definition(group, dtype):
    """quantize_rows_triton (rotation and rounding in one launch) against quantize_rows_reference bit for bit, with
    an all-zero group and a group of one value among the rows."""
    gen = torch.Generator().manual_seed(group + 3)
    a = torch.randn(3, 768, generator=gen).to(dtype)
    a[1, 256:512] = 0
    a[2, 300:] = 0
    a[2, 600] = -2.5
    signs = weights.random_signs(group, seed=group) if group else None
    want = act8.quantize_rows_reference(a, group, signs)
    got = act8.quantize_rows_triton(a, group, signs)
    used = 768 // 4 + 2 * 768 // act8.E8_GROUP
    assert got.shape == want.shape == (3, act8.row_words(768))
    assert torch.equal(got[:, :used], want[:, :used])


def test_rows_hold_the_rounding_of_the_definition():
    """The row's bytes, scales and sums are group_scales' q and s (the definition of the rounding) in the layout the
    kernel reads: byte b of word w is q[4w + b]."""
    a = torch.randn(2, 512, generator=torch.Generator().manual_seed(1))
    q, s = act8.group_scales(a, act8.E8_GROUP)
    row = act8.quantize_rows_reference(a)
    got_q = row[:, :128].contiguous().view(torch.int8).reshape(2, 2, 256).float()
    assert torch.equal(got_q, q)
    assert torch.equal(row[:, 128:130].contiguous().view(torch.float32), s)
    assert torch.equal(row[:, 130:132], q.sum(-1).to(torch.int32))
    assert act8.int8_group("e8p", 512) == 256 and act8.int8_group("e8p3", 576) is None


def test_int8_rounding_applies_to_each_projection_an_integer_body_takes(monkeypatch):
    """e8p with D = 576 (not whole groups of 256): gate_up keeps unrounded activations, down (K = I = 256) rounds
    them per 256, in the reference (the next test: in the dispatch)."""
    x, w, ids, gu, dn = _problem("e8p", 2, 576, 256, tokens=2, top_k=1, seed=1)
    rounded = []
    quantize = moe_reference.fake_quantize
    monkeypatch.setattr(moe_reference, "fake_quantize", lambda a, group: rounded.append((a.shape[-1], group))
                        or quantize(a, group))
    ref = fused_moe_reference(x, w, ids, gu, dn, int8_activations=True)
    assert rounded and all(r == (256, act8.E8_GROUP) for r in rounded)  # h only, each expert's rows
    assert not torch.equal(ref, fused_moe_reference(x, w, ids, gu, dn))


def test_a_projection_the_integer_body_cannot_take_stays_on_float_activations(monkeypatch, caplog):
    """D = 576: gate_up takes the float body on the rotated x, down the integer body on h's int8 rows (the kernels
    stubbed: the dispatch is what is checked), and the log says which weights stay on float activations."""
    x, w, ids, gu, dn = _problem("e8p", 2, 576, 256, tokens=1, top_k=2, seed=2)
    calls = []
    monkeypatch.setattr(moe_cuda_int8, "expert_kernel", lambda w, dual, dtype: None if dual else "integer kernel")
    monkeypatch.setattr(moe, "launch_expert_decode",
                        lambda a, out, *args, **kw: calls.append(("float", a.shape[1])) or out.zero_())
    monkeypatch.setattr(moe_cuda_int8, "launch_expert_cuda",
                        lambda kernel, act, out, *args, **kw: calls.append((kernel, act.shape[1])) or out.zero_())
    moe.fused_moe_triton(x, w, ids, gu, dn, gemv=True, int8_activations=True)
    assert calls == [("float", 576), ("integer kernel", act8.row_words(256))]
    assert "e8p weights of 576 inputs stay on float activations" in caplog.text


# ---- on the GPU ----------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu


def _int8_kernel_or_skip(w, dual, dtype=torch.bfloat16):
    kernel = moe_cuda_int8.expert_kernel(w, dual, dtype)
    if kernel is None:
        pytest.skip("NVRTC did not provide the integer kernel on this host (see the log)")
    return kernel


def _down(w: ExpertWeights, act: torch.Tensor, ids: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
    """One non-dual launch on activation rows ``act``, the output poisoned first so unwritten rows show."""
    kernel = _int8_kernel_or_skip(w, dual=False)
    out = torch.full((act.shape[0], w.shape[1]), float("nan"), dtype=torch.float32, device="cuda")
    moe_cuda_int8.launch_expert_cuda(kernel, act, out, ids.to(torch.int32).cuda(), w, routing=routing.float().cuda())
    return out.cpu()


def _unit_rows(k: int) -> torch.Tensor:
    """Activation rows of q = e_p (scale 1, Σq 1 in p's group): row p of the output is column p of the weights."""
    rows = torch.zeros((k, act8.row_words(k)), dtype=torch.int32)
    q = torch.eye(k, dtype=torch.int8).contiguous().view(torch.int32)
    groups = k // act8.E8_GROUP
    rows[:, : k // 4] = q
    rows[:, k // 4 : k // 4 + groups] = torch.tensor(1.0).view(torch.int32)
    rows[:, k // 4 + groups : k // 4 + 2 * groups] = (torch.arange(k)[:, None] // act8.E8_GROUP == torch.arange(groups)).int()
    return rows.cuda()


@gpu
def test_every_e8p_code_through_the_integer_body():
    """Rows of 32 codes (K = 256), all 65,536 codes; unit activation rows, so out[p, n] is weight (n, p), exactly."""
    codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).reshape(2048, 32)
    w = ExpertWeights("e8p", (1, 2048, 256), {"codes": codes[None].cuda(),
                                              "scale": torch.ones((1, 2048), dtype=torch.float16, device="cuda")})
    got = _down(w, _unit_rows(256), torch.zeros(256), torch.ones(256)).T
    assert torch.equal(got, e8p.decode(codes).reshape(2048, 256)), "a code decodes wrongly in the integer body"


@gpu
def test_every_residual_code_through_the_integer_body():
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(-(1 << 15), 1 << 15, (32, 32), generator=gen, dtype=torch.int32).to(torch.int16)
    residual = torch.arange(1024, dtype=torch.int32).remainder(256).to(torch.uint8).reshape(32, 32)
    w = ExpertWeights("e8p3", (1, 32, 256), {"codes": codes[None].cuda(), "residual": residual[None].cuda(),
                                             "scale": torch.ones((1, 32), dtype=torch.float16, device="cuda")})
    got = _down(w, _unit_rows(256), torch.zeros(256), torch.ones(256)).T
    want = (e8p.decode(codes) + e8p.decode_residual(residual)).reshape(32, 256)
    assert (got - want).abs().max() < 1e-6, "a residual code decodes wrongly in the integer body"


# (format, experts, rows N, inputs K): odd N, one and five K steps.
LAUNCH_CASES = [("e8p", 5, 37, 1280), ("e8p3", 3, 70, 256), ("e8p", 2, 16, 512)]


@gpu
@pytest.mark.parametrize("fmt,num_e,n,k", LAUNCH_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_down_launch_matches_float64_on_the_rounded_activations(fmt, num_e, n, k, dtype):
    """The stored weights times fake_quantize(a), in float64: the products are exact integers, so only the float32
    sums over K steps and the scales round."""
    w, a, ids, routing = down_problem(fmt, num_e, n, k, dtype)
    got = _down(w, act8.quantize_rows_triton(a.cuda()), ids, routing).double()
    dense = w.dequantize(dtype=torch.float64).cpu()
    a8 = act8.fake_quantize(a, act8.E8_GROUP).double()
    want = routing.double()[:, None] * torch.einsum("pnk,pk->pn", dense[ids], a8)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, f"integer down launch differs from float64 (max error {err:.1e} of the largest output)"


@gpu
@pytest.mark.parametrize("fmt,num_e,n,k", LAUNCH_CASES)
def test_gate_up_launch_matches_float64_on_the_rounded_activations(fmt, num_e, n, k):
    w = _random_weights(fmt, num_e, 2 * n, k, seed=2 * n + k)
    gen = torch.Generator().manual_seed(2)
    tokens, top_k = 3, 2
    a = torch.randn(tokens, k, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, num_e, (tokens * top_k,), generator=gen)
    kernel = _int8_kernel_or_skip(w, dual=True)
    h = torch.full((tokens * top_k, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe_cuda_int8.launch_expert_cuda(kernel, act8.quantize_rows_triton(a.cuda()), h, ids.to(torch.int32).cuda(), w,
                                     dual=True, a_row_div=top_k)
    dense = w.dequantize(dtype=torch.float64).cpu()
    a8 = act8.fake_quantize(a, act8.E8_GROUP).double()
    g = torch.einsum("pnk,pk->pn", dense[ids], a8.repeat_interleave(top_k, 0))
    want = torch.nn.functional.silu(g[:, :n]) * g[:, n:]
    err = (h.cpu().double() - want).abs()
    worst = (err - 2.0**-8 * want.abs()).max().item() / want.abs().max().item()  # h is rounded to bf16
    assert worst < 1e-5, f"integer gate_up launch differs from float64 beyond rounding h ({worst:.1e} of the largest)"


def _row_values(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Activation rows (quantize_rows_reference's layout) -> the float64 values s·q they stand for, [T, k]."""
    groups = k // act8.E8_GROUP
    q = rows[:, : k // 4].contiguous().view(torch.int8).double().reshape(-1, groups, act8.E8_GROUP)
    s = rows[:, k // 4 : k // 4 + groups].contiguous().view(torch.float32).double()
    return (q * s[..., None]).reshape(-1, k)


def _int8_op64(x, w, ids, gu, dn, round_x: bool = True) -> torch.Tensor:
    """The op as the integer path rounds it, in float64 from the torch definitions: x rotated, stored in x's dtype
    and rounded to int8 (quantize_rows_reference; with ``round_x`` False only rotated and stored, as the float body
    takes it), h stored in x's dtype, rotated, stored and rounded likewise."""
    top_k, i = ids.shape[1], dn.shape[2]
    gu64, dn64 = gu.dequantize(dtype=torch.float64), dn.dequantize(dtype=torch.float64)
    if round_x:
        xq = _row_values(act8.quantize_rows_reference(x, gu.group, gu.signs), x.shape[1])
    else:
        xq = gu.rotate_input(x).double()
    flat = ids.reshape(-1)
    g = torch.einsum("pnk,pk->pn", gu64[flat], xq.repeat_interleave(top_k, 0))
    h = (torch.nn.functional.silu(g[:, :i]) * g[:, i:]).to(x.dtype)
    hq = _row_values(act8.quantize_rows_reference(h, dn.group, dn.signs), i)
    y = w.reshape(-1, 1).double() * torch.einsum("pnk,pk->pn", dn64[flat], hq)
    return y.reshape(ids.shape[0], top_k, -1).sum(1)


@gpu
@pytest.mark.parametrize("fmt,tokens", [("e8p", 1), ("e8p", 8), ("e8p3", 1), ("e8p3", 8)])
def test_fused_op_on_int8_activations_matches_its_float64_definition(fmt, tokens, monkeypatch):
    """The dispatched op (both launches on the integer body: counted) against _int8_op64, a token routed twice to
    one expert and an expert without tokens (_problem); what is left is float32 sums, h's rounding (which may move
    a q by one step) and y's."""
    x, w, ids, gu, dn = _problem(fmt, 5, 512, 256, tokens, 3, seed=tokens + len(fmt))
    calls = []
    launch = moe_cuda_int8.launch_expert_cuda
    monkeypatch.setattr(moe_cuda_int8, "launch_expert_cuda", lambda *a, **k: calls.append(1) or launch(*a, **k))
    xb = x.to(torch.bfloat16)
    got = moe.fused_moe_triton(xb.cuda(), w.cuda(), ids.cuda(), gu.to("cuda"), dn.to("cuda"), gemv=True,
                               int8_activations=True).double().cpu()
    if not calls:
        pytest.skip("NVRTC did not provide the integer kernel on this host")
    assert len(calls) == 2
    want = _int8_op64(xb, w, ids, gu, dn)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 5e-3, f"integer-body op differs from its float64 definition (relative error {err:.1e})"


@gpu
@pytest.mark.parametrize("fmt", ["e8p", "e8p3"])
def test_mixed_op_float_gate_up_and_integer_down_matches_its_float64_definition(fmt, monkeypatch):
    """D = 576, the embedded model's hidden size (not whole groups of 256): gate_up on the float CUDA body with x
    unrounded, down on the integer body on h's int8 rows (each launch counted), against _int8_op64 with x
    unrounded: the dispatch the embedded model's e8p MLPs take, on the GPU."""
    x, w, ids, gu, dn = _problem(fmt, 5, 576, 256, 3, 3, seed=11)
    calls = []
    for module in (moe_cuda, moe_cuda_int8):
        launch = module.launch_expert_cuda
        monkeypatch.setattr(module, "launch_expert_cuda",
                            lambda *a, module=module, launch=launch, **k: calls.append(module) or launch(*a, **k))
    xb = x.to(torch.bfloat16)
    got = moe.fused_moe_triton(xb.cuda(), w.cuda(), ids.cuda(), gu.to("cuda"), dn.to("cuda"), gemv=True,
                               int8_activations=True).double().cpu()
    if moe_cuda_int8 not in calls:
        pytest.skip("NVRTC did not provide the integer kernel on this host")
    assert calls == [moe_cuda, moe_cuda_int8]
    want = _int8_op64(xb, w, ids, gu, dn, round_x=False)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 5e-3, f"mixed-body op differs from its float64 definition (relative error {err:.1e})"
