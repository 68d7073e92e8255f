"""The turbo recent window through the engine: rows handed out and returned with pages, preempted sequences
recompute into a fresh row and continue exactly as without the pressure."""

from __future__ import annotations

from runtime_toy import ToyConfig, ToyLoaded, ToyModel, assert_pages_return, make_engine, run_all
from server.runtime.sequence import SamplingParams


def prompt(n: int, salt: int) -> list[int]:
    return [(37 * i + 11 * salt + 5) % 256 for i in range(n)]


def test_preempted_turbo_sequences_resume_identically_and_return_pages_and_rows():
    loaded = ToyLoaded(model=ToyModel(ToyConfig(head_dim=64), seed=3), config=ToyConfig(head_dim=64))
    requests = {f"r{i}": (prompt(10 + 6 * i, i), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
                for i in range(5)}  # fmt: skip
    window = dict(kv_cache_dtype="turbo3", kv_recent_window=4, max_model_len=128)
    roomy = make_engine(loaded, num_pages=4096, **window)
    try:
        expected = run_all(roomy, requests)
    finally:
        roomy.shutdown()
    # Rows of 8 KiB take half of 48 KiB: 3 rows and 29 pages of 4 tokens; three requests need 10-16 pages each.
    tight = make_engine(loaded, num_pages=48, max_num_batched_tokens=16, **window)
    try:
        kv = tight.kv_cache
        assert (kv.recent_rows, kv.num_pages) == (3, 29), "the pool's shape moved: adjust the budget"
        results = run_all(tight, requests)
        assert tight.scheduler.num_preemptions > 0, "the pool was never short: the test proves nothing"
        assert_pages_return(tight)
        assert len(kv.free_recent_rows) == kv.recent_rows, "recent-window rows leaked"
    finally:
        tight.shutdown()
    for rid in requests:
        assert results[rid].error is None and results[rid].token_ids == expected[rid].token_ids, rid
