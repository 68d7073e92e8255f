"""Tokenizer: text <-> token ids and the chat template, from a Hugging Face directory or GGUF metadata.

Both sources end in a ``tokenizers.Tokenizer``. A GGUF file carries a byte-level BPE as token strings,
merges, token types and a pre-tokenizer name (llama.cpp's ``tokenizer.ggml.pre``); we rebuild the same
pre-tokenization llama.cpp applies for that name.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

log = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType)
_CONTROL, _USER_DEFINED = 3, 4

# Split patterns of llama.cpp's pre-tokenizers, by their GGUF name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level_gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # StarCoder-style: every digit its own piece, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level_gpt2])
    if pre in _GGUF_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_GGUF_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in (None, "default", "gpt2", "gpt-2"):
        log.warning("GGUF pre-tokenizer %r is not known here; using GPT-2's split (as llama.cpp's default)", pre)
    return byte_level_gpt2


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # Templates print tool schemas with it; non-ASCII stays readable, as transformers renders it.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _byte_level_decoding() -> dict[str, int]:
    """GPT-2 byte-level BPE spells byte b as one printable character; this maps it back.
    Printable Latin-1 bytes stand for themselves, the other 68 take code points 256 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def _render_error(message: str) -> None:
    raise jinja2.TemplateError(message)


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
        add_bos: bool,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos and bos_token_id is not None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _render_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            self._template = env.from_string(chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Adds BOS only when the model asks for it and the text does not start with it
        (chat templates often write BOS themselves)."""
        # encode_batch releases the GIL and encode does not: a megabyte prompt (seconds of work) must not
        # stall the server's event loop, which tokenizes in a worker thread.
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (a token may hold part of a UTF-8 character, which
        ``decode([token_id])`` shows as U+FFFD); OpenAI's logprobs report these bytes."""
        piece = self.backend.id_to_token(token_id) or ""
        if isinstance(self.backend.decoder, decoders.ByteLevel):
            table = _byte_level_decoding()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int | None) -> str:
        piece = None if token_id is None else self.backend.id_to_token(token_id)
        return piece or ""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render messages [{"role", "content"}] with the model's template (sandboxed jinja2).

        Raises ValueError when the model has no template or the template rejects the conversation."""
        if self._template is None:
            raise ValueError(
                "this model has no chat template; use the completions endpoint with a plain prompt instead"
            )
        bos = self.token_text(self.bos_token_id)
        eos = self.token_text(min(self.eos_token_ids)) if self.eos_token_ids else ""
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, **extra
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the model's chat template rejected the messages: {e}") from e


def _token_id(backend: BackendTokenizer, token: Any) -> int | None:
    if isinstance(token, dict):  # tokenizer_config.json may spell it {"content": "<s>", ...}
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)


def tokenizer_from_hf_dir(path: str, eos_token_ids: frozenset[int] = frozenset()) -> Tokenizer:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, as transformers 5 writes it)."""
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_file):
        raise FileNotFoundError(
            f"{path} has no tokenizer.json; save the tokenizer with the model (tokenizer.save_pretrained(dir))"
        )
    backend = BackendTokenizer.from_file(tok_file)
    cfg_file = os.path.join(path, "tokenizer_config.json")
    tc = json.load(open(cfg_file, encoding="utf-8")) if os.path.exists(cfg_file) else {}
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.exists(jinja_file):
        template = open(jinja_file, encoding="utf-8").read()
    bos = _token_id(backend, tc.get("bos_token"))
    eos = _token_id(backend, tc.get("eos_token"))
    add_bos = tc.get("add_bos_token")
    if add_bos is None:  # the post-processor decides (Llama's TemplateProcessing adds BOS)
        add_bos = bos is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos]
    eos_ids = frozenset(eos_token_ids) | ({eos} if eos is not None else set())
    return Tokenizer(backend, template, bos, eos_ids, bool(add_bos))


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """Rebuild the tokenizer from GGUF ``tokenizer.*`` metadata (a dict of field name -> value)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "use the Hugging Face directory of this model instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre")
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        ignore_merges=pre in ("llama-bpe", "llama3"),  # llama.cpp keeps whole-vocab words unmerged for Llama 3
    )
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    # Control and user-defined tokens are matched whole in the text, never split by the BPE (as llama.cpp does).
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = {eos} if eos is not None else set()
    if meta.get("tokenizer.ggml.eot_token_id") is not None:  # end-of-turn ends a chat reply too
        eos_ids.add(meta["tokenizer.ggml.eot_token_id"])
    return Tokenizer(
        backend,
        meta.get("tokenizer.chat_template"),
        bos,
        frozenset(eos_ids),
        bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )
