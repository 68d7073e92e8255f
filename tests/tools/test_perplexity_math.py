"""Windowing and statistics of `turboserve perplexity`, checked against hand-worked values."""

import math

import pytest

from server.tools.perplexity import PerplexityError, format_final_line, scored_nlls, split_windows, summarize


def test_windows_do_not_overlap_and_drop_the_short_tail():
    assert split_windows(list(range(10)), ctx=4, max_chunks=None, bos_token_id=None) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_chunks_caps_the_window_count():
    assert split_windows(list(range(100)), ctx=8, max_chunks=3, bos_token_id=None) == [
        list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]  # fmt: skip


def test_bos_starts_every_window_like_llama_cpp():
    assert split_windows([5, 6, 7, 8, 9, 10, 11, 12], ctx=4, max_chunks=None, bos_token_id=1) == [
        [1, 6, 7, 8], [1, 10, 11, 12]]  # fmt: skip


def test_text_shorter_than_one_window_is_a_clear_error():
    with pytest.raises(PerplexityError, match="7 tokens, shorter than one window of --ctx 8"):
        split_windows(list(range(7)), ctx=8, max_chunks=None, bos_token_id=None)


@pytest.mark.parametrize("ctx,chunks,match", [(2, None, "--ctx must be at least 4"), (8, 0, "--chunks must be")])
def test_bad_window_settings_are_clear_errors(ctx, chunks, match):
    with pytest.raises(PerplexityError, match=match):
        split_windows(list(range(100)), ctx=ctx, max_chunks=chunks, bos_token_id=None)


def test_only_the_second_half_is_scored():
    # ctx 6: positions 4 and 5 are scored (each sees at least 3 = ctx/2 tokens before it).
    assert scored_nlls([None, -1.0, -2.0, -3.0, -4.0, -5.0], ctx=6) == [4.0, 5.0]
    # odd ctx 7: first = 3, so positions 4, 5, 6.
    assert scored_nlls([None, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0], ctx=7) == [4.0, 5.0, 6.0]


def test_missing_or_short_logprobs_are_engine_faults():
    with pytest.raises(RuntimeError, match="5 prompt logprobs for a window of 6"):
        scored_nlls([None, -1.0, -2.0, -3.0, -4.0], ctx=6)
    with pytest.raises(RuntimeError, match="no logprob"):
        scored_nlls([None, -1.0, -2.0, -3.0, None, -5.0], ctx=6)


def test_ppl_and_uncertainty_follow_llama_cpp():
    # NLLs 1, 1, 3, 3: mean 2, population variance 1, n = 4.
    result = summarize([[1.0, 1.0], [3.0, 3.0]], ctx=6, n_text_tokens=12)
    assert result.ppl == pytest.approx(math.e**2)
    assert result.ppl_error == pytest.approx(math.e**2 * math.sqrt(1 / 3))
    assert result.chunk_ppls == pytest.approx([math.e, math.e**3])
    assert (result.n_chunks, result.n_scored_tokens, result.n_text_tokens) == (2, 4, 12)
    assert format_final_line(result) == f"PPL = {math.e**2:.4f} +/- {math.e**2 * math.sqrt(1 / 3):.5f}"


def test_identical_nlls_have_zero_uncertainty():
    result = summarize([[0.5, 0.5, 0.5]], ctx=8, n_text_tokens=8)
    assert result.ppl == pytest.approx(math.exp(0.5)) and result.ppl_error == 0.0
