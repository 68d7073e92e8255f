"""GPU check and timing of paged_prefill's recent window: `python bench/prefill_recent_check.py [--sweep]`.

CI runs the window in Triton's interpreter at toy sizes; here it meets bf16 and real shapes (32 query /
8 KV heads, d128, 16-token pages, a 2048-token chunk after a 16K and a 64K prefix, W = 128):
1. correctness vs a float32 torch reference on upcast inputs (relative L2 error), for a single chunk and a
   mixed batch (decode row, whole prompt, idle sequence). The exact keys carry a shared direction the
   queries also carry, so the window holds a large share of the softmax mass: a key read from the wrong array
   moves the output by far more than bf16 rounding (the "window effect" column says by how much). Exact rows
   past a sequence's last position hold 1000.0, which must not show;
2. median time of paged_prefill without a window and with W = 128 (2048-token chunks after 4K, 16K, 64K) in each
   launch setting of dense_attention._prefill_launches (the fastest of each kernel, then the fallback for GPUs they
   do not fit); with --sweep in 44 settings (tiles, warps, stages, register cap) instead.
Exits non-zero when a correctness check fails.
"""

from __future__ import annotations

import itertools
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import environment_line, require_gpu, time_ms  # noqa: E402
from server.kernels import dense_attention  # noqa: E402
from server.kernels.dense_attention import paged_prefill  # noqa: E402

PAGE, Q_HEADS, KV_HEADS, DIM, WINDOW = 16, 32, 8, 128, 128
SCALE = DIM**-0.5
failures: list[str] = []


def make_inputs(seq_lens, query_lens, device, dtype=torch.bfloat16):
    """Shuffled pages, far and exact K/V, queries leaning toward the exact keys, and the launch metadata."""
    pages_per_seq = [-(-n // PAGE) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 4
    order = torch.randperm(num_pages, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32, device=device)
    used = 0
    for s, n in enumerate(pages_per_seq):
        tables[s, :n] = order[used : used + n]
        used += n
    shape = (num_pages, PAGE, KV_HEADS, DIM)
    near_shape = (len(seq_lens), max(query_lens) + WINDOW - 1, KV_HEADS, DIM)  # paged_prefill's exact rows
    lean = torch.nn.functional.normalize(torch.randn(KV_HEADS, DIM, device=device), dim=-1)
    k_far, v_far = (torch.randn(shape, device=device).to(dtype) for _ in range(2))
    v_near = torch.randn(near_shape, device=device).to(dtype)
    k_near = (torch.randn(near_shape, device=device) + 7.5 * lean).to(dtype)  # logit +7.5 * 7.5 * SCALE, about 5
    q = (torch.randn(sum(query_lens), Q_HEADS, DIM, device=device)
         + 7.5 * lean.repeat_interleave(Q_HEADS // KV_HEADS, dim=0)).to(dtype)  # fmt: skip
    for s, (n, m) in enumerate(zip(seq_lens, query_lens)):  # rows past the last position, which must not show
        k_near[s, n - _first_exact(n, m) :] = 1000.0
        v_near[s, n - _first_exact(n, m) :] = 1000.0
    starts = torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_far, v_far, k_near, v_near, tables, lens, starts


def _first_exact(n, m):
    """The first position a sequence of n tokens, m of them queries, reads exactly: its exact rows' first."""
    return max(0, n - m - WINDOW + 1)


def _tokens(pages_of, pages, n, kv):
    """float32 [n, len(kv), D]: a sequence's first n tokens (its pages in order) at KV heads kv."""
    return pages_of[pages].reshape(-1, KV_HEADS, DIM)[:n].index_select(1, kv).float()


def _exact_tokens(rows_of, s, n, m, kv):
    """float32 [n, len(kv), D]: sequence s's exact rows at their positions, zero before them."""
    out = torch.zeros(n, len(kv), DIM, device=rows_of.device)
    first = _first_exact(n, m)
    out[first:] = rows_of[s, : n - first].index_select(1, kv).float()
    return out


def reference(q, k_far, v_far, k_near, v_near, tables, seq_lens, query_lens, window):
    """float32: per sequence, 4 query heads at a time; window None = no exact pages."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    row = 0
    for s, (n, m) in enumerate(zip(seq_lens, query_lens)):
        if m == 0:
            continue
        pages = tables[s, : -(-n // PAGE)].long()
        t = torch.arange(n - m, n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        near = j > t - window if window else torch.zeros_like(j > t)
        for h0 in range(0, Q_HEADS, 4):
            kv = torch.arange(h0, h0 + 4, device=q.device) // (Q_HEADS // KV_HEADS)
            qh = q[row : row + m, h0 : h0 + 4].float()
            scores = torch.einsum("lhd,nhd->hln", qh, _tokens(k_far, pages, n, kv))
            if window:
                scores = torch.where(near, torch.einsum("lhd,nhd->hln", qh, _exact_tokens(k_near, s, n, m, kv)),
                                     scores)  # fmt: skip
            probs = torch.softmax((scores * SCALE).masked_fill(j > t, float("-inf")), dim=-1)
            o = torch.einsum("hln,nhd->lhd", probs * ~near, _tokens(v_far, pages, n, kv))
            if window:
                o += torch.einsum("hln,nhd->lhd", probs * near, _exact_tokens(v_near, s, n, m, kv))
            out[row : row + m, h0 : h0 + 4] = o
            del scores, probs
        row += m
    return out


def relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_case(name, seq_lens, query_lens, device):
    q, k_far, v_far, k_near, v_near, tables, lens, starts = make_inputs(seq_lens, query_lens, device)
    exact = (k_near, v_near, WINDOW)
    fast = paged_prefill(q, k_far, v_far, tables, lens, starts, max(query_lens), SCALE, exact=exact)
    plain = paged_prefill(q, k_far, v_far, tables, lens, starts, max(query_lens), SCALE)
    expected = reference(q, k_far, v_far, k_near, v_near, tables, seq_lens, query_lens, WINDOW)
    expected_plain = reference(q, k_far, v_far, k_near, v_near, tables, seq_lens, query_lens, None)
    for label, got, want in ((f"W={WINDOW}", fast, expected), ("no window", plain, expected_plain)):
        err = relative(got, want)
        ok = err < 1e-2 and bool(torch.isfinite(got).all())
        print(f"{'ok  ' if ok else 'FAIL'} {name} {label}: relative L2 error {err:.2e} (limit 1e-2), "
              f"window effect {relative(expected, expected_plain):.2e}", flush=True)  # fmt: skip
        if not ok:
            failures.append(f"{name} {label}")


def sweep_settings() -> list[dict]:
    """The launch settings --sweep times: tiles, warps, stages, with and without the 128-register cap."""
    return [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s, **({"maxnreg": 128} if cap else {}))
            for m, n, w, s, cap in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3), (False, True))
            if not (m == n == 128 and w == 4)]


def time_case(prefix, chunk, settings, device):
    seq_len = prefix + chunk
    q, k_far, v_far, k_near, v_near, tables, lens, starts = make_inputs([seq_len], [chunk], device)
    flops = 4 * DIM * Q_HEADS * (chunk * prefix + chunk * (chunk + 1) // 2)

    def run(exact):
        return lambda i: paged_prefill(q, k_far, v_far, tables, lens, starts, chunk, SCALE, exact=exact)

    rows = []
    launches = dense_attention._prefill_launches
    for setting, (label, exact) in itertools.product(settings, [("no window", None),
                                                                (f"W={WINDOW}", (k_near, v_near, WINDOW))]):
        try:
            dense_attention._prefill_launches = lambda block_d, window: [setting]
            ms = time_ms(run(exact), warmup=3, iters=20, device=device)
            rows.append(f"| {prefix // 1024}K + {chunk} | {label} | {setting} | {ms:.3f} | {flops / ms / 1e9:.0f} |")
        except Exception:  # one failed trial must not lose the others
            traceback.print_exc()
            rows.append(f"| {prefix // 1024}K + {chunk} | {label} | {setting} | failed | |")
        finally:
            dense_attention._prefill_launches = launches
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    device = require_gpu()
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in full float32
    print(environment_line(device), flush=True)
    cases = [("chunk 2048 after 16K", [16384 + 2048], [2048]),
             ("chunk 2048 after 64K", [65536 + 2048], [2048]),
             ("mixed batch", [18432, 4097, 300, 50, 70000], [2048, 1, 300, 0, 517])]  # fmt: skip
    for name, seq_lens, query_lens in cases:
        try:
            check_case(name, seq_lens, query_lens, device)
        except Exception:
            traceback.print_exc()
            failures.append(name)
        torch.cuda.empty_cache()
    settings = sweep_settings() if "--sweep" in sys.argv else [
        *dense_attention._prefill_launches(DIM, False)[:1], *dense_attention._prefill_launches(DIM, True)]
    rows = ["| context | paged_prefill | launch | ms | TFLOP/s |", "| --- | --- | --- | ---: | ---: |"]
    for prefix in (4096, 16384, 65536):
        rows += time_case(prefix, 2048, settings, device)
    print("\n" + "\n".join(rows))
    if failures:
        print(f"FAILED: {failures}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
