"""Incremental detokenization: whole characters only, stop strings cut and held back."""

from __future__ import annotations

from runtime_toy import ByteTokenizer

from server.runtime.detokenizer import IncrementalDetokenizer

TOKENIZER = ByteTokenizer()  # one token per UTF-8 byte: multi-byte characters span tokens


def feed(text: str, stop=(), include_stop=False, prompt=b"hi "):
    detok = IncrementalDetokenizer(TOKENIZER, list(prompt), list(stop), include_stop)
    released = [detok.add_token(t) for t in text.encode("utf-8")]
    return detok, released


def test_multibyte_characters_are_never_split():
    text = "héllo wörld 日本語 😀!"
    detok, released = feed(text)
    assert "".join(released) + detok.finish() == text
    assert all("\ufffd" not in piece for piece in released)
    # The 4-byte emoji arrives on its last byte, all at once.
    emoji_end = len("héllo wörld 日本語 😀".encode())
    assert released[emoji_end - 4 : emoji_end] == ["", "", "", "😀"]


def test_stop_string_spanning_tokens_is_cut_and_finishes():
    detok, released = feed("abc STOP def", stop=["STOP"])
    assert "".join(released) == "abc "
    assert detok.stopped and detok.finish() == ""


def test_include_stop_str_in_output_keeps_the_stop_string():
    detok, released = feed("abc STOP def", stop=["STOP"], include_stop=True)
    assert "".join(released) == "abc STOP"


def test_text_that_may_start_a_stop_string_is_held_back_until_ruled_out():
    detok = IncrementalDetokenizer(TOKENIZER, [], ["STOP"], False)
    out = [detok.add_token(t) for t in b"ab ST"]
    assert "".join(out) == "ab "  # "ST" could become "STOP"
    assert detok.add_token(ord("x")) == "STx"  # ruled out: released at once
    assert detok.add_token(ord("S")) == ""
    assert detok.finish() == "S"  # the sequence ended for another reason: nothing stays held


def test_earliest_of_several_stop_strings_wins_and_multibyte_stops_match():
    detok, released = feed("xx→yy end", stop=["end", "→y"])
    assert "".join(released) == "xx" and detok.stopped
    detok, released = feed("le café noir", stop=["é n"])
    assert "".join(released) == "le caf"


def test_stop_string_in_the_prompt_does_not_stop_the_output():
    detok, released = feed("fine", stop=["hi"], prompt=b"say hi ")
    assert "".join(released) + detok.finish() == "fine" and not detok.stopped


def test_a_character_cut_off_at_the_end_is_dropped_not_sent_as_a_replacement_character():
    detok = IncrementalDetokenizer(TOKENIZER, [], [], False)
    assert detok.add_token(ord("a")) == "a"
    assert detok.add_token(0xE6) == ""  # first byte of a 3-byte character: wait
    assert detok.add_token(0x97) == ""  # second byte
    assert detok.finish() == ""  # the sequence ended before the third


def test_invalid_bytes_inside_the_text_still_show_as_replacement_characters():
    detok = IncrementalDetokenizer(TOKENIZER, [], [], False)
    released = [detok.add_token(t) for t in b"a\xffb"]  # 0xFF is never valid UTF-8
    assert "".join(released) + detok.finish() == "a\ufffdb"


def test_stop_strings_count_only_after_min_tokens():
    """min_tokens (one token per byte here): a stop string within the first min_tokens tokens is text like any
    other, released at once; the first one after them ends the sequence."""
    detok = IncrementalDetokenizer(TOKENIZER, [], ["ab"], False, min_tokens=4)
    released = [detok.add_token(t) for t in b"xab.ab.ab"]
    assert released[:4] == ["x", "a", "b", "."], "nothing held back before min_tokens"
    assert "".join(released) == "xab." and detok.stopped
