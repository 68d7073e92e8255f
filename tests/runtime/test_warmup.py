"""The start-up warm-up (server/runtime/warmup.py) on the toy engine: it runs each kind of eager step it exists for,
returns every page, and leaves its requests out of the request metrics, which a client's request still reaches."""

from __future__ import annotations

from prometheus_client import REGISTRY
from runtime_toy import assert_pages_return, make_engine, toy_loaded

from server.runtime.sequence import SamplingParams
from server.runtime.warmup import ARRIVAL_LENGTHS, BURST, warm_up


def _requests_seen(name: str) -> float:
    return REGISTRY.get_sample_value("turboserve_time_to_first_token_seconds_count", {"model_name": name}) or 0.0


def test_the_warm_up_runs_every_kind_of_eager_step_and_records_no_request():
    # The toy model holds 512 positions: a 437-token lead prompt in two chunks, the burst of 4 x 100 in one step.
    engine = make_engine(toy_loaded(), max_num_batched_tokens=400)
    steps = []
    launch = engine.runner.launch

    def record(chunks, after=None):
        steps.append([(c.start, c.num_tokens, c.seq.num_prompt_tokens) for c in chunks])
        return launch(chunks, after)

    engine.runner.launch = record
    try:
        before = _requests_seen(engine.model_name)
        assert warm_up(engine) > 0
        assert _requests_seen(engine.model_name) == before, "the warm-up's requests are not clients'"
        assert_pages_return(engine)
        engine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
        assert _requests_seen(engine.model_name) == before + 1, "a client's request is recorded"
    finally:
        engine.shutdown()

    def prompt_chunks(step):
        return [(start, n, prompt) for start, n, prompt in step if start < prompt]

    def decode_rows(step):
        return [row for row in step if row[0] >= row[2]]

    assert any(start > 0 for step in steps for start, _, _ in prompt_chunks(step)), "a chunk over a cached prefix"
    mixed = [step for step in steps if prompt_chunks(step) and decode_rows(step)]
    assert mixed, "prompt chunks beside a decode row"
    assert any(n == 1 for step in mixed for _, n, prompt in prompt_chunks(step) if prompt == 1), "a 1-token prompt"
    assert {prompt for step in mixed for _, _, prompt in prompt_chunks(step)} >= set(ARRIVAL_LENGTHS)
    assert any(len(prompt_chunks(step)) == len(BURST) and not decode_rows(step) for step in steps), "a burst"
