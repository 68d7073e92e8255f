"""bench/serve_load.py on a CPU: the random checkpoint loads as the shape it was written from, and two servers (f32
and turbo3 KV) under a KV budget too small for f32 serve every request, preempting only where the pages run out
and leaving none owned."""

import argparse
import dataclasses

import torch

from bench.e2e import SHAPES
from bench.serve_load import Scenario, measure, write_random_checkpoint
from server.runtime.models.loader import load_model

SHAPE = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=2)


def test_the_random_checkpoint_loads_as_its_shape(tmp_path):
    write_random_checkpoint(str(tmp_path), SHAPE)
    loaded = load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    fields = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")
    assert {f: getattr(loaded.config, f) for f in fields} == {f: getattr(SHAPE, f) for f in fields}
    assert loaded.tokenizer.decode([7, 4000]).split() == ["t7", "t4000"]
    std = loaded.model.embed_tokens.weight.float().std()
    assert 0.015 < std < 0.025, "weights drawn with std 0.02"


def test_servers_under_a_small_kv_budget_serve_everything_and_leave_no_page():
    args = argparse.Namespace(shape="smollm2-135m", kv_cache_dtype="f32,turbo3", kv_cache_memory="2MiB",
                              max_model_len=512, max_num_seqs=4, device="cpu", serve_args=[], seed=0,
                              keep_dir=None)
    scenario = Scenario("long", concurrency=4, prompts=6, input_len=200, output_len=64)
    results, pools = measure(args, SHAPE, [scenario])
    by_kv = {kv: summary for kv, _, summary in results}
    assert set(by_kv) == {"f32", "turbo3"} and set(pools) == {"f32", "turbo3"}
    for kv, summary in by_kv.items():
        assert summary["completed"] == 6 and summary["failed"] == 0, (kv, summary["errors"])
        assert summary["output_tokens"] == 6 * 64
        assert summary["pages_used_after"] == 0 and summary["engine_alive"] == 1
    # 2 MiB holds 672 f32 tokens: three of the 264-token sequences it admits outgrow it, so some are preempted;
    # turbo3's pages hold 4192, and its two window rows admit two sequences at a time (kv_cache.py), so none is.
    assert by_kv["f32"]["preemptions"] > 0
    assert by_kv["turbo3"]["preemptions"] == 0
