"""The engine end to end on a tiny random model: batching, preemption, abort, faults, validation."""

from __future__ import annotations

import threading

import pytest
import torch
from runtime_toy import EOS, Collector, assert_pages_return, make_engine, run_all, toy_loaded

from server.kernels.paged_kv import AttentionMetadata, DenseKVStore
from server.runtime.engine import EngineNotRunning, EngineOverloaded, RequestRejected
from server.runtime.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return toy_loaded(seed=1)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(37 * i + 11 * salt + 5) % 256 for i in range(n)]


def greedy_by_full_recompute(loaded, tokens: list[int], max_tokens: int) -> list[int]:
    """Reference: every step recomputes the whole sequence into fresh contiguous pages."""
    model, c = loaded.model, loaded.config
    tokens = list(tokens)
    for _ in range(max_tokens):
        n = len(tokens)
        stores = [DenseKVStore(1, n, c.num_kv_heads, c.head_dim, torch.float32, "cpu") for _ in range(c.num_layers)]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n),
            block_tables=torch.zeros(1, 1, dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens_cpu=[n],
            query_lens_cpu=[n],
        )
        with torch.inference_mode():
            hidden = model.forward(torch.tensor(tokens), torch.arange(n), stores, meta)
            tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return tokens[-max_tokens:]


def test_greedy_matches_full_recompute_reference(loaded):
    engine = make_engine(loaded, max_num_batched_tokens=8)  # chunked: the 21-token prompt takes 3 steps
    try:
        for n in (1, 4, 21):
            out = engine.generate(prompt(n), GREEDY)
            assert out.token_ids == greedy_by_full_recompute(loaded, prompt(n), 12), f"prompt length {n}"
            assert out.finish_reason == "length" and out.num_generated_tokens == 12
    finally:
        engine.shutdown()


def mixed_batch(target_params: SamplingParams) -> dict[str, tuple[list[int], SamplingParams]]:
    """7 prompts of very different lengths and output lengths, then the target: it is admitted
    last, so its row in the batch moves as the others finish."""
    requests = {}
    for i, n in enumerate((1, 40, 7, 29, 3, 55, 17)):
        params = SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True)
        requests[f"other{i}"] = (prompt(n, salt=i + 2), params)
    requests["target"] = (prompt(13, salt=1), target_params)
    return requests


def record_schedules(engine) -> list[list[tuple[str, int, bool]]]:
    """Wrap the runner to keep (request, chunk length, decode?) of every step launched (scheduled ahead or not)."""
    steps, launch = [], engine.runner.launch

    def recording(chunks, after=None):
        steps.append([(c.seq.request_id, c.num_tokens, c.start >= c.seq.num_prompt_tokens) for c in chunks])
        return launch(chunks, after)

    engine.runner.launch = recording
    return steps


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=1.3, top_k=40, top_p=0.95, seed=1234, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_prompt_alone_and_inside_mixed_batch_give_identical_tokens(loaded, params):
    alone_engine = make_engine(loaded)
    try:
        alone = alone_engine.generate(prompt(13, salt=1), params).token_ids
    finally:
        alone_engine.shutdown()
    engine = make_engine(loaded, max_num_batched_tokens=10)
    steps = record_schedules(engine)
    try:
        results = run_all(engine, mixed_batch(params))
    finally:
        engine.shutdown()
    assert results["target"].token_ids == alone
    # The scenario really happened: the target shared steps with prefill chunks and decodes.
    shared = [s for s in steps if any(r == "target" for r, _, _ in s) and len(s) > 1]
    assert any(any(not dec and r != "target" for r, _, dec in s) for s in shared), "no prefill beside the target"
    assert any(any(dec and r != "target" for r, _, dec in s) for s in shared), "no decode beside the target"
    assert any(n < 13 for s in steps for r, n, dec in s if r == "target" and not dec), "target prefill was not chunked"


def test_preempted_sequences_resume_identically_and_free_every_page(loaded):
    requests = {
        f"r{i}": (
            prompt(6 + 5 * i, salt=i),
            SamplingParams(
                max_tokens=20, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True, prompt_logprobs=i == 2
            ),
        )
        for i in range(6)
    }
    roomy = make_engine(loaded)
    try:
        expected = run_all(roomy, requests)
    finally:
        roomy.shutdown()
    # Each request needs up to 12 pages; 14 pages hold about one at a time.
    tight = make_engine(loaded, num_pages=14, max_num_batched_tokens=16)
    try:
        results = run_all(tight, requests)
        assert tight.scheduler.num_preemptions > 0, "the pool was never short: the test proves nothing"
        assert_pages_return(tight)
    finally:
        tight.shutdown()
    for rid in requests:
        assert results[rid].token_ids == expected[rid].token_ids, rid
        assert results[rid].finish_reason == "length"
    prompt_logprobs = results["r2"].outputs[0].prompt_logprobs
    assert prompt_logprobs == pytest.approx(expected["r2"].outputs[0].prompt_logprobs, abs=1e-5)
    assert len(prompt_logprobs) == len(requests["r2"][0]), "prompt logprobs duplicated by the recompute"


def test_abort_mid_prefill_and_mid_decode_frees_all_pages(loaded):
    engine = make_engine(loaded, max_num_batched_tokens=8)
    collector = Collector()
    seen = {}

    def ticker(out):  # runs in the engine thread once per step of the ticking request
        tick(out)
        n = len(collector.outputs["ticker"])
        if n == 2:  # "long" is still prefilling (100 tokens at <= 7 per step)
            seen["long"] = engine._requests["long"].num_computed_tokens
            engine.abort("long")
        if n == 4:  # "decoding" got its first tokens and is decoding
            seen["decoding"] = len(engine._requests["decoding"].output_token_ids)
            engine.abort("decoding")

    tick = collector.callback("ticker")
    try:
        engine.submit("ticker", prompt(1), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), ticker)
        long_decode = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        engine.submit("decoding", prompt(2), long_decode, collector.callback("decoding"))
        engine.submit("long", prompt(100), GREEDY, collector.callback("long"))
        results = collector.wait()
        assert 0 < seen["long"] < 100
        assert seen["decoding"] > 0
        assert results["long"].finish_reason == "abort" and results["long"].token_ids == []
        assert results["decoding"].finish_reason == "abort" and len(results["decoding"].token_ids) < 200
        assert results["ticker"].finish_reason == "length"
        assert_pages_return(engine)
    finally:
        engine.shutdown()


def test_exception_in_a_step_fails_only_the_affected_request(loaded):
    poison = 255
    engine = make_engine(loaded)
    forward = loaded.model.forward

    def faulty_forward(input_ids, *args):
        if (input_ids == poison).any():
            raise RuntimeError("injected fault")
        return forward(input_ids, *args)

    engine.model.forward = faulty_forward  # the instance attribute shadows the method for this engine's runner
    try:
        healthy = {f"ok{i}": (prompt(5 + i, salt=i), GREEDY) for i in range(3)}
        results = run_all(engine, {**healthy, "bad": ([1, 2, poison, 3], GREEDY)})
        assert results["bad"].finish_reason == "error" and "injected fault" in results["bad"].error
        for rid, (p, _) in healthy.items():
            assert results[rid].finish_reason == "length"
            assert results[rid].token_ids == greedy_by_full_recompute(loaded, p, 12), rid
        again = engine.generate(prompt(9), GREEDY)  # the loop still serves
        assert again.finish_reason == "length" and engine.is_alive()
        assert_pages_return(engine)
    finally:
        del engine.model.forward
        engine.shutdown()


def test_requests_that_can_never_be_served_are_rejected_at_submit(loaded):
    engine = make_engine(loaded, num_pages=8, max_model_len=100)  # 8 pages = 32 tokens
    noop = lambda out: None  # noqa: E731
    cases = [
        ([], GREEDY, "prompt"),
        ([1, 2, 300], GREEDY, "prompt"),
        (prompt(95), SamplingParams(max_tokens=10), "max_tokens"),
        (prompt(120), SamplingParams(max_tokens=1), "prompt"),
        (prompt(30), SamplingParams(max_tokens=10), "max_tokens"),  # fits the context, not the pool
        (prompt(3), SamplingParams(temperature=-1.0), "temperature"),
        (prompt(3), SamplingParams(top_p=0.0), "top_p"),
        (prompt(3), SamplingParams(max_tokens=0), "max_tokens"),
    ]
    try:
        for i, (ids, params, param) in enumerate(cases):
            with pytest.raises(RequestRejected) as err:
                engine.submit(f"bad{i}", ids, params, noop)
            assert err.value.param == param, f"case {i}: {err.value}"
        assert_pages_return(engine)
        assert engine.generate(prompt(20), GREEDY).finish_reason == "length"  # 32 tokens: exactly fits
    finally:
        engine.shutdown()


def test_full_queue_raises_overloaded(loaded):
    engine = make_engine(loaded, max_queue=2)
    release = threading.Event()
    collector = Collector()
    first = collector.callback("blocker")

    def blocking(out):  # holds the engine thread so submissions stay queued
        first(out)
        release.wait(30)

    try:
        engine.submit("blocker", prompt(3), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), blocking)
        while not collector.outputs["blocker"]:
            threading.Event().wait(0.01)
        for i in range(2):
            engine.submit(f"q{i}", prompt(3), GREEDY, collector.callback(f"q{i}"))
        with pytest.raises(EngineOverloaded):
            engine.submit("one-too-many", prompt(3), GREEDY, lambda out: None)
        release.set()
        assert all(r.finish_reason == "length" for r in collector.wait().values())
    finally:
        release.set()
        engine.shutdown()


def test_stop_token_ids_eos_and_stop_strings(loaded):
    engine = make_engine(loaded)
    try:
        free_run = engine.generate(prompt(6), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)).token_ids
        stop_at = 5
        by_id = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[free_run[stop_at]])
        stopped = engine.generate(prompt(6), by_id)
        first = free_run.index(free_run[stop_at])
        assert stopped.token_ids == free_run[: first + 1] and stopped.finish_reason == "stop"

        # The toy model never emits its EOS (256) greedily; make the stop token its EOS instead.
        eos_engine = make_engine(loaded, max_num_batched_tokens=64)
        eos_engine.eos_token_ids = frozenset({free_run[stop_at]})
        try:
            eos_stop = eos_engine.generate(prompt(6), SamplingParams(max_tokens=12, temperature=0.0))
            assert eos_stop.token_ids == free_run[: first + 1] and eos_stop.finish_reason == "stop"
            ignored = eos_engine.generate(prompt(6), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            assert ignored.token_ids == free_run and ignored.finish_reason == "length"
        finally:
            eos_engine.shutdown()

        full_text = loaded.tokenizer.decode(free_run)
        stop_str = full_text[4:6]  # "Y\u00a7": ASCII then a 2-byte character, three tokens
        assert len(stop_str.encode()) == 3, "the model changed: pick a stop string spanning tokens again"
        by_str = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop_str])
        by_string = engine.generate(prompt(6), by_str)
        assert by_string.finish_reason == "stop"
        assert by_string.text == full_text[: full_text.index(stop_str)]
        completing = next(k for k in range(1, 13) if stop_str in loaded.tokenizer.decode(free_run[:k]))
        assert by_string.token_ids == free_run[:completing], "tokens after the stop string leaked out"
        assert_pages_return(engine)
        assert EOS not in by_string.token_ids
    finally:
        engine.shutdown()


def test_min_tokens_keeps_stop_ids_and_eos_from_ending_it_early(loaded):
    """vLLM's min_tokens: the stop id that ended the greedy run early cannot be among the first 8 tokens, so the
    run takes the next-best token there and goes on; after them it may end on that id again."""
    engine = make_engine(loaded)
    eos_engine = make_engine(loaded)
    try:
        free_run = engine.generate(prompt(6), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)).token_ids
        stop_id = free_run[5]
        first = free_run.index(stop_id)
        assert first < 7, "the model changed: pick a stop id the free run meets before token 8"
        for name, eng, params in (
            ("stop_token_ids", engine, SamplingParams(max_tokens=12, min_tokens=8, temperature=0.0,
                                                      stop_token_ids=[stop_id])),
            ("eos", eos_engine, SamplingParams(max_tokens=12, min_tokens=8, temperature=0.0)),
        ):
            eos_engine.eos_token_ids = frozenset({stop_id})
            out = eng.generate(prompt(6), params)
            assert len(out.token_ids) > 8, f"{name}: ended after {len(out.token_ids)} tokens"
            assert stop_id not in out.token_ids[:8], f"{name}: the stop id was among the first min_tokens tokens"
            assert out.token_ids[:first] == free_run[:first], f"{name}: min_tokens changed tokens it need not"
            ended_by_it = out.finish_reason == "stop" and out.token_ids[-1] == stop_id
            assert ended_by_it or (out.finish_reason == "length" and len(out.token_ids) == 12), name
        with pytest.raises(RequestRejected, match="min_tokens"):
            engine.generate(prompt(6), SamplingParams(max_tokens=4, min_tokens=5))
        assert_pages_return(engine)
    finally:
        engine.shutdown()
        eos_engine.shutdown()


def test_shutdown_ends_live_requests_with_abort_and_refuses_new_ones(loaded):
    engine = make_engine(loaded, max_num_batched_tokens=4)
    collector = Collector()
    engine.submit("live", prompt(100), SamplingParams(max_tokens=300, ignore_eos=True), collector.callback("live"))
    engine.shutdown()
    assert collector.wait()["live"].finish_reason == "abort"
    assert_pages_return(engine)
    assert not engine.is_alive()
    with pytest.raises(EngineNotRunning, match="not running"):
        engine.submit("late", prompt(3), GREEDY, lambda out: None)


def test_a_failure_while_publishing_fails_only_that_request(loaded):
    engine = make_engine(loaded)
    poison = 250

    class FaultyTokenizer(type(loaded.tokenizer)):
        def decode(self, ids, skip_special_tokens=True):
            if poison in ids:
                raise UnicodeError("injected decode fault")
            return super().decode(ids, skip_special_tokens)

    try:
        good_prompt = prompt(7)
        expected = engine.generate(good_prompt, GREEDY).token_ids
        assert poison not in good_prompt + expected, "pick another poison token: the healthy request meets it"
        engine.tokenizer = FaultyTokenizer()  # detokenizers made from now on use it
        results = run_all(engine, {"good": (good_prompt, GREEDY), "bad": ([3, 4, poison], GREEDY)})
        assert results["bad"].finish_reason == "error" and "injected decode fault" in results["bad"].error
        assert results["good"].finish_reason == "length" and results["good"].token_ids == expected
        assert_pages_return(engine)
    finally:
        engine.shutdown()


def test_steps_respect_max_num_seqs_and_the_token_budget_with_decodes_first(loaded):
    engine = make_engine(loaded, max_num_seqs=3, max_num_batched_tokens=9)
    steps = record_schedules(engine)
    try:
        requests = {f"r{i}": (prompt(4 + 7 * i, salt=i), GREEDY) for i in range(6)}
        results = run_all(engine, requests)
    finally:
        engine.shutdown()
    assert all(r.finish_reason == "length" for r in results.values())
    assert max(len(s) for s in steps) == 3, "max_num_seqs was not reached or was exceeded"
    assert max(sum(n for _, n, _ in s) for s in steps) == 9, "the token budget was not filled or was exceeded"
    for s in steps:
        kinds = [n == 1 and dec for _, n, dec in s]
        assert kinds == sorted(kinds, reverse=True), f"a prefill chunk was scheduled before a decode: {s}"


@pytest.mark.parametrize("setting", [{"max_num_seqs": 0}, {"max_num_batched_tokens": 0}])
def test_settings_that_could_never_run_a_step_are_refused(loaded, setting):
    with pytest.raises(ValueError, match=f"{next(iter(setting))}=0 must be at least 1"):
        make_engine(loaded, **setting)


def test_a_shut_down_engine_is_freed_once_dropped(loaded):
    """Nothing global keeps a shut-down engine (and its KV pool) alive: a process that builds engines one after
    another gets each pool back. /metrics then reads it as not alive."""
    import gc
    import weakref

    from prometheus_client import REGISTRY

    engine = make_engine(loaded, max_model_len=64)
    engine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    name, ref = engine.model_name, weakref.ref(engine)
    engine.shutdown()
    assert REGISTRY.get_sample_value("turboserve_engine_alive", {"model_name": name}) == 0.0
    del engine
    gc.collect()
    assert ref() is None, f"still referenced by {[type(r).__name__ for r in gc.get_referrers(ref())]}"
