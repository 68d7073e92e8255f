"""Async scheduling: a decode step launched before the previous step's tokens reach the host
changes nothing a client can see, and its pages come back."""

from __future__ import annotations

import threading

import pytest
import torch
from runtime_toy import Collector, assert_pages_return, make_engine, run_all, toy_loaded

from server.config import EngineConfig
from server.runtime.kv_cache import KVCache, KVLayout
from server.runtime.model_runner import LaunchedStep
from server.runtime.scheduler import Scheduler
from server.runtime.sequence import SamplingParams, Sequence, SequenceStatus


@pytest.fixture(scope="module")
def loaded():
    return toy_loaded(seed=11)


def prompt(n: int, salt: int) -> list[int]:
    return [(salt * 37 + 11 * i) % 256 for i in range(n)]


def count_ahead_steps(engine) -> list[list[tuple[int, bool]]]:
    """Wrap schedule_ahead to keep every step it launched, as (tokens, ahead) of each chunk."""
    steps, schedule_ahead = [], engine.scheduler.schedule_ahead

    def recording(in_flight, prompts=True):
        chunks = schedule_ahead(in_flight, prompts)
        if chunks:
            steps.append([(c.num_tokens, c.ahead) for c in chunks])
        return chunks

    engine.scheduler.schedule_ahead = recording
    return steps


def requests_of_every_kind(free_run: list[int], stop_str: str) -> dict[str, tuple[list[int], SamplingParams]]:
    greedy = dict(temperature=0.0, ignore_eos=True)
    return {
        "greedy": (prompt(13, 1), SamplingParams(max_tokens=24, **greedy)),
        "seeded": (prompt(9, 2), SamplingParams(max_tokens=20, temperature=1.2, top_p=0.9, seed=7, ignore_eos=True)),
        "logprobs": (prompt(5, 3), SamplingParams(max_tokens=18, logprobs=3, **greedy)),
        "one_token": (prompt(7, 4), SamplingParams(max_tokens=1, **greedy)),
        "two_tokens": (prompt(30, 5), SamplingParams(max_tokens=2, **greedy)),
        "stop_token": (prompt(6, 0), SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[free_run[5]])),
        "stop_string": (prompt(6, 0), SamplingParams(max_tokens=24, stop=[stop_str], **greedy)),
        "penalized": (prompt(11, 6), SamplingParams(max_tokens=4, repetition_penalty=1.3, **greedy)),  # blocks ahead steps while it runs
    }


def flat_logprobs(finished) -> list[tuple[list[int], float]]:
    """(chosen then top token ids, chosen logprob) of every generated token that carried logprobs."""
    return [
        ([lp.token_id] + [t for t, _ in lp.top], lp.logprob)
        for out in finished.outputs
        for lp in out.logprobs or []
    ]


def run_engine(loaded, requests, async_scheduling: bool):
    engine = make_engine(loaded, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    ahead = count_ahead_steps(engine)
    try:
        results = run_all(engine, requests)
        assert_pages_return(engine)
    finally:
        engine.shutdown()
    return results, ahead


def greedy_free_run(loaded, max_tokens: int) -> list[int]:
    """What prompt(6, 0) continues with when nothing stops it (the stop tests pick their stops from it)."""
    engine = make_engine(loaded)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return engine.generate(prompt(6, 0), params).token_ids
    finally:
        engine.shutdown()


def test_outputs_with_async_scheduling_equal_the_synchronous_engine(loaded):
    free_run = greedy_free_run(loaded, 24)
    stop_str = loaded.tokenizer.decode(free_run[8:10])
    requests = requests_of_every_kind(free_run, stop_str)
    sync, none_ahead = run_engine(loaded, requests, async_scheduling=False)
    async_, ahead = run_engine(loaded, requests, async_scheduling=True)
    assert not none_ahead
    assert len(ahead) >= 5, f"only {len(ahead)} steps were launched ahead: the test proves little"
    mixed = [step for step in ahead if any(n > 1 for n, _ in step) and any(a for _, a in step)]
    assert mixed, "no step ahead put a prompt chunk beside in-flight tokens"
    for rid in requests:
        a, s = async_[rid], sync[rid]
        assert (a.token_ids, a.text, a.finish_reason) == (s.token_ids, s.text, s.finish_reason), rid
        # Steps may group the sequences differently, so float32 sums may round differently.
        for lp_a, lp_s in zip(flat_logprobs(a), flat_logprobs(s), strict=True):
            assert lp_a[0] == lp_s[0] and lp_a[1] == pytest.approx(lp_s[1], abs=1e-5), rid
    assert sync["stop_token"].finish_reason == "stop" and sync["stop_string"].finish_reason == "stop"
    assert len(flat_logprobs(sync["logprobs"])) == 18


def test_an_eos_sampled_while_a_step_runs_ahead_ends_the_request_there(loaded):
    free_run = greedy_free_run(loaded, 12)
    engine = make_engine(loaded)
    engine.eos_token_ids = frozenset({free_run[4]})
    ahead = count_ahead_steps(engine)
    # The step launched ahead still writes the ended sequence's pages (on a GPU its kernels may still
    # run): every launched step is collected, and its sequences keep their pages until then.
    launched, collected_with_pages = [], []
    launch, collect = engine.runner.launch, engine.runner.collect

    def recording_launch(chunks, after=None):
        launched.append(chunks)
        return launch(chunks, after)

    def recording_collect(step):
        collected_with_pages.append(all(c.seq.block_table for c in step.chunks))
        return collect(step)

    engine.runner.launch, engine.runner.collect = recording_launch, recording_collect
    try:
        out = engine.generate(prompt(6, 0), SamplingParams(max_tokens=12, temperature=0.0))
        assert out.token_ids == free_run[: free_run.index(free_run[4]) + 1]
        assert out.finish_reason == "stop" and ahead
        assert_pages_return(engine)
        assert len(collected_with_pages) == len(launched), "a step launched ahead was never collected"
        assert all(collected_with_pages), "pages went back before the step writing them was collected"
    finally:
        engine.shutdown()


def test_abort_while_a_step_runs_ahead_frees_every_page(loaded):
    engine = make_engine(loaded, max_num_batched_tokens=8)
    ahead = count_ahead_steps(engine)
    collector = Collector()
    first_token = threading.Event()
    on_output = collector.callback("long")

    def watch(out):
        on_output(out)
        if out.token_ids:
            first_token.set()

    try:
        engine.submit("long", prompt(20, 9), SamplingParams(max_tokens=400, ignore_eos=True), watch)
        assert first_token.wait(timeout=30)
        engine.abort("long")
        assert collector.wait()["long"].finish_reason == "abort"
        assert ahead, "the request was aborted before any step ran ahead"
        assert_pages_return(engine)
        assert engine.generate(prompt(4, 3), SamplingParams(max_tokens=3, ignore_eos=True)).finish_reason == "length"
    finally:
        engine.shutdown()


# -- the scheduler's rule, without a model ------------------------------------------------------


def decoding(scheduler: Scheduler, params: SamplingParams, n_prompt: int = 15, name: str = "s") -> Sequence:
    seq = Sequence(name, list(range(n_prompt)), params, seed=0)
    scheduler.add(seq)
    (chunk,) = [c for c in scheduler.schedule() if c.seq is seq]
    seq.num_computed_tokens += chunk.num_tokens
    seq.append_token(1)
    return seq


def scheduler_with(num_pages: int) -> Scheduler:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4)
    page_bytes = 2 * 4 * 4 * 4  # K+V, 4 tokens, head_dim 4, float32
    kv = KVCache(layout, "f32", "f32", num_pages * page_bytes, 4, torch.device("cpu"), torch.float32)
    assert kv.num_pages == num_pages
    return Scheduler(EngineConfig(max_num_batched_tokens=64), kv)


PLAIN = SamplingParams(max_tokens=10, ignore_eos=True)


def test_schedule_ahead_takes_the_next_position_and_its_page():
    scheduler = scheduler_with(8)
    seq = decoding(scheduler, PLAIN)  # 16 tokens: 4 pages, the 17th needs a fifth
    in_flight = scheduler.schedule()
    (ahead,) = scheduler.schedule_ahead(in_flight)
    assert (ahead.seq, ahead.start, ahead.num_tokens, ahead.ahead, ahead.samples) == (seq, 16, 1, True, True)
    assert len(seq.block_table) == 5


@pytest.mark.parametrize(
    "case",
    ["penalty", "last_token", "pool_short", "finished"],
)
def test_schedule_ahead_declines_when_the_next_step_could_differ(case):
    scheduler = scheduler_with(5 if case == "pool_short" else 16)
    params = {
        "penalty": SamplingParams(max_tokens=10, frequency_penalty=0.5, ignore_eos=True),
        "last_token": SamplingParams(max_tokens=2, ignore_eos=True),  # the step in flight samples its last
    }.get(case, PLAIN)
    seq = decoding(scheduler, params)
    other = decoding(scheduler, PLAIN, n_prompt=3, name="other") if case == "pool_short" else None
    in_flight = scheduler.schedule()
    if case == "finished":
        seq.finish_reason = "stop"
    tables = [list(s.block_table) for s in (seq, other) if s is not None]
    assert scheduler.schedule_ahead(in_flight) == []
    assert [list(s.block_table) for s in (seq, other) if s is not None] == tables, "a declined step took pages"



def test_schedule_ahead_is_the_step_schedule_takes_once_the_tokens_are_known():
    """Decodes beside prompts in chunks: every step scheduled ahead (decodes of in-flight tokens, prompts' next
    chunks, admissions from the waiting queue) is the step schedule() decides after the step in flight has
    finished."""
    scheduler = scheduler_with(64)
    scheduler.max_num_batched_tokens = 16
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    decoding(scheduler, params, n_prompt=15, name="a")
    for name, n in (("b", 40), ("c", 5)):
        scheduler.add(Sequence(name, list(range(n)), params, seed=0))
    steps = [scheduler.schedule()]  # a's decode and b's first chunk; c waits for budget
    kinds = set()
    for _ in range(8):
        in_flight = steps[-1]
        ahead = scheduler.schedule_ahead(in_flight)
        assert ahead, [(c.seq.request_id, c.start, c.num_tokens) for c in in_flight]
        kinds |= {"admission" if c.start == 0 else "prompt chunk" if c.num_tokens > 1 else "in-flight token"
                  for c in ahead}  # fmt: skip
        for chunk in in_flight:  # the step in flight finishes: its K/V are in, its samplers' tokens arrive
            chunk.seq.num_computed_tokens += chunk.num_tokens
            if chunk.samples:
                chunk.seq.append_token(7)
        scheduled = scheduler.schedule()
        assert [(c.seq, c.start, c.num_tokens, c.samples) for c in ahead] == [
            (c.seq, c.start, c.num_tokens, c.samples) for c in scheduled
        ]
        steps.append(ahead)
    assert kinds == {"admission", "prompt chunk", "in-flight token"}, kinds


def test_schedule_ahead_declines_a_prompt_chunk_whose_prompt_logprobs_wait_for_the_step_in_flight():
    scheduler = scheduler_with(16)
    scheduler.max_num_batched_tokens = 8
    scheduler.add(Sequence("p", list(range(20)), SamplingParams(max_tokens=4, prompt_logprobs=1), seed=0))
    in_flight = scheduler.schedule()
    assert [c.num_tokens for c in in_flight] == [8]
    assert scheduler.schedule_ahead(in_flight) == []


def test_schedule_ahead_puts_decodes_first_whatever_the_admission_order():
    """After a preemption the older of two running sequences may be the one still in its prompt: schedule() runs
    the newer one's decode first, and so must the step ahead (its in-flight token then comes from a row other
    than its own in the step in flight)."""
    scheduler = scheduler_with(32)
    scheduler.max_num_batched_tokens = 8
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    old = Sequence("old", list(range(20)), params, seed=0)
    new = decoding(scheduler, params, n_prompt=6, name="new")
    old.status = SequenceStatus.RUNNING
    scheduler.running.insert(0, old)  # admitted first, preempted, resumed: still in its prompt
    in_flight = scheduler.schedule()
    assert [(c.seq, c.num_tokens) for c in in_flight] == [(new, 1), (old, 7)]
    for _ in range(3):
        ahead = scheduler.schedule_ahead(in_flight)
        for chunk in in_flight:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            if chunk.samples:
                chunk.seq.append_token(7)
        assert [(c.seq, c.start, c.num_tokens) for c in ahead] == [
            (c.seq, c.start, c.num_tokens) for c in scheduler.schedule()
        ]
        in_flight = ahead
    assert [c.seq for c in ahead] == [old, new] and all(c.ahead for c in ahead)


def test_async_scheduling_is_off_by_default_on_a_cpu(loaded):
    """On a CPU the launch is the computation: running the next step first would only delay this one's tokens."""
    engine = make_engine(loaded, async_scheduling=None)
    ahead = count_ahead_steps(engine)
    try:
        out = engine.generate(prompt(20, 4), SamplingParams(max_tokens=12, ignore_eos=True))
        assert len(out.token_ids) == 12 and not ahead
    finally:
        engine.shutdown()


@pytest.mark.parametrize("host_bound", [False, True])
def test_eager_steps_stop_going_ahead_once_the_step_in_flight_finishes_first(loaded, monkeypatch, host_bound):
    """Where the step in flight is already done when the next is queued (a host slower than the device), eager
    steps (prompt chunks) wait for their tokens for EAGER_AHEAD_PAUSE_STEPS; steps of in-flight tokens alone still
    go ahead. A CPU step is never found done, so the test says which it is."""
    monkeypatch.setattr(LaunchedStep, "finished_already", lambda self: host_bound)
    engine = make_engine(loaded, max_num_batched_tokens=8)
    ahead = count_ahead_steps(engine)
    try:
        requests = {f"r{i}": (prompt(3 + 25 * i, i), SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(3)}
        run_all(engine, requests)
    finally:
        engine.shutdown()
    with_prompts = [i for i, step in enumerate(ahead) if not all(a for _, a in step)]
    assert len(ahead) > 20
    if host_bound:
        assert with_prompts == [0], with_prompts  # the first one shows the host bound; then a pause
    else:
        assert len(with_prompts) > 1, with_prompts
