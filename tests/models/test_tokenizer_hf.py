"""Tokenizers and chat templates from Hugging Face directories, against transformers' AutoTokenizer."""

from __future__ import annotations

import json

import pytest
import transformers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from server.runtime.models.tokenizer import tokenizer_from_hf_dir
from tiny_checkpoints import write_tokenizer

# A Llama-3-like template: writes BOS itself, loops, conditionals, raise_exception, whitespace control.
TEMPLATE = (
    "{{ bos_token }}{{ {'b': [1, 'é'], 'a': none} | tojson(sort_keys=true) }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "t5 t6"},
    {"role": "user", "content": "  t7 t8  "},
    {"role": "assistant", "content": "t9"},
    {"role": "user", "content": "t10"},
]


def _dir_with_template(tmp_path, where: str):
    write_tokenizer(str(tmp_path), chat_template=TEMPLATE if where == "jinja file" else None)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if where == "tokenizer_config":
        cfg["chat_template"] = TEMPLATE
    elif where == "named list":
        cfg["chat_template"] = [{"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": "x"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("where", ["jinja file", "tokenizer_config", "named list"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(tmp_path, where, generation_prompt):
    path = _dir_with_template(tmp_path, where)
    ours = tokenizer_from_hf_dir(path).apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt)
    ref = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        MESSAGES, add_generation_prompt=generation_prompt, tokenize=False
    )
    assert ours == ref
    assert ours.startswith('t1{"a": null, "b": [1, "é"]}system: t5 t6t2\n')


def test_template_errors_and_missing_template_are_clear(tmp_path):
    tok = tokenizer_from_hf_dir(_dir_with_template(tmp_path, "jinja file"))
    with pytest.raises(ValueError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "t3"}])
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer_from_hf_dir(str(tmp_path)).apply_chat_template(MESSAGES)


def test_template_cannot_reach_python_internals(tmp_path):
    write_tokenizer(str(tmp_path), chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template"):
        tokenizer_from_hf_dir(str(tmp_path)).apply_chat_template(MESSAGES)


def test_bos_added_once_when_the_post_processor_adds_it(tmp_path):
    write_tokenizer(str(tmp_path))
    backend = BackendTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="t1 $A", special_tokens=[("t1", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = tokenizer_from_hf_dir(str(tmp_path))
    assert tok.bos_token_id == 1 and tok.eos_token_ids == frozenset({2})
    assert tok.encode("t5 t6") == [1, 5, 6]
    assert tok.encode("t1 t5") == [1, 5]  # a template that writes BOS itself does not get a second one
    assert tok.encode("t5", add_special_tokens=False) == [5]


def test_no_bos_without_a_post_processor(tmp_path):
    write_tokenizer(str(tmp_path))
    assert tokenizer_from_hf_dir(str(tmp_path)).encode("t5 t6") == [5, 6]
