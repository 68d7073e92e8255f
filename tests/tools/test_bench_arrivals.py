"""bench/e2e.py --arrivals on the CPU's tiny shape: prompts arrive in chunks beside decoding requests (mixed
steps), every one gets its first token, the running requests are aborted at the end, and no page is left behind."""

import torch

from bench.e2e import SHAPES, arrivals_under_load, build_random_model, make_engine


def test_arrivals_under_load_time_every_arrival_and_leave_the_cache_empty():
    cfg = SHAPES["tiny"]
    loaded = build_random_model(cfg, torch.device("cpu"), torch.float32)
    engine = make_engine(loaded, 4, 512, "auto", 4 * 512, 32)  # 70-token prompts in chunks of 32: mixed steps
    try:
        result = arrivals_under_load(engine, batch=3, depth=40, arrival_len=70, vocab=cfg.vocab_size)
    finally:
        engine.shutdown()
    assert engine.kv_cache.num_used_pages == 0, "aborted and finished requests must return their pages"
    assert 0 < result["ttft"] < 30 and 0 < result["longest_wait"] < 30
    assert result["tok_s"] > 0, "the running requests decode beside each prompt's chunks"
