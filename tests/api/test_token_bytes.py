"""Tokenizer.token_bytes, which logprobs report: exact bytes even for a piece of a UTF-8 character."""

from __future__ import annotations

import gguf
import pytest

from server.runtime.models.gguf_loader import read_metadata
from server.runtime.models.loader import embedded_model_path
from server.runtime.models.tokenizer import tokenizer_from_gguf


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizer_from_gguf(read_metadata(gguf.GGUFReader(embedded_model_path())))


def test_token_bytes_concatenate_to_the_utf8_of_the_text(tokenizer):
    text = "héllo 日本語 🙂👍🏽 naïve\n\tcafé <|im_end|> Ω≈ç√"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    assert any(_is_partial(p) for p in pieces), "no token split a character; pick a harder text"


def test_every_whole_token_has_the_bytes_of_its_text(tokenizer):
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            assert tokenizer.token_bytes(token_id) == text.encode("utf-8"), token_id


def _is_partial(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True
