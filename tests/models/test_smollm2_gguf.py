"""The embedded SmolLM2 GGUF: our loader, tokenizer and forward vs transformers' own GGUF loading."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from paged_batch import PagedBatch, assert_matches_reference, greedy
from server.runtime.models.loader import embedded_model_path, load_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; 12345 + 678 = 13023.",
    "héllo 世界 🙂 naïve café — «quotes»",
    "  leading spaces\n\ttabs and\r\nnewlines   ",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x**2  # comment",
]


@pytest.fixture(scope="module")
def ours():
    return load_model(None, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def reference():
    path = embedded_model_path()
    folder, file = os.path.dirname(path), os.path.basename(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32).eval()
    return tokenizer, model


def test_config_and_name_from_gguf_metadata(ours):
    c = ours.config
    assert ours.name == "SmolLM2-135M-Instruct"
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert (c.rope_theta, c.max_position_embeddings, c.tie_word_embeddings) == (100000.0, 8192, True)
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert ours.tokenizer.eos_token_ids == frozenset({2}) and ours.tokenizer.bos_token_id == 1


def test_raw_quantized_blocks_are_kept(ours):
    raw = ours.raw_weights["layers.0.self_attn.q_proj.weight"]
    assert raw.ggml_type.name == "Q4_1" and raw.shape == (576, 576)
    # Dequantizing the kept (un-permuted) blocks gives exactly the weights the model multiplies by.
    import gguf

    q_rows = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.ggml_type).reshape(raw.shape))
    q_model = ours.model.layers[0].self_attn.qkv_proj.weight[:576]
    assert torch.equal(q_rows, q_model)
    assert ours.raw_weights["embed_tokens.weight"].ggml_type.name == "Q8_0"


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(ours, reference, text):
    ref_tok, _ = reference
    ids = ours.tokenizer.encode(text)
    assert ids == ref_tok.encode(text, add_special_tokens=False)
    assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_digits_are_split_one_per_token(ours):
    """llama.cpp's 'smollm' pre-tokenizer (StarCoder's) gives every digit its own token."""
    ids = ours.tokenizer.encode("31415926")
    assert [ours.tokenizer.decode([i]) for i in ids] == list("31415926")


def test_special_tokens_skipped_on_decode(ours):
    ids = ours.tokenizer.encode("<|im_start|>assistant\nParis<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.tokenizer.decode(ids) == "assistant\nParis"


def test_chat_template_matches_transformers(ours, reference):
    ref_tok, _ = reference
    text = ours.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert text == ref_tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")


def test_greedy_32_tokens_match_transformers_gguf_loading(ours, reference):
    _, ref_model = reference
    prompt = ours.tokenizer.encode(ours.tokenizer.apply_chat_template(QUESTION))
    generated, logits = greedy(PagedBatch(ours.model, num_pages=32, page_size=16), {"q": prompt}, 32)
    assert ours.tokenizer.decode(generated["q"]).startswith("The capital of France is Paris.")
    assert_matches_reference(ref_model, {"q": prompt}, generated, logits)
