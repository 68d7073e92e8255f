"""A tiny random-weight transformer and a byte tokenizer with the loader's interfaces.

Small enough for CPU tests, yet every output depends on the whole cached context (learned
positions, two attention layers, GQA), so a KV or scheduling mistake changes the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from server.runtime.engine import Engine

EOS = 256  # the one special token, after the 256 bytes


class ByteTokenizer:
    """Token i < 256 is byte i, so multi-byte UTF-8 characters span several tokens."""

    eos_token_ids = frozenset({EOS})
    bos_token_id = None
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 257
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    max_position_embeddings: int = 512
    eos_token_ids: tuple[int, ...] = (EOS,)


class ToyModel(nn.Module):
    def __init__(self, config: ToyConfig, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        c = self.config = config

        def weight(*shape, scale=1.0):
            return nn.Parameter(torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5)

        self.embed = weight(c.vocab_size, c.hidden_size, scale=c.hidden_size**0.5)
        self.pos = weight(c.max_position_embeddings, c.hidden_size, scale=c.hidden_size**0.5)
        self.unembed = weight(c.vocab_size, c.hidden_size, scale=4.0)  # untied: the model must not just echo
        self.logits_dtype = torch.float32
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.layers = nn.ModuleList(
            nn.ParameterDict(
                {
                    "q": weight(q, c.hidden_size),
                    "k": weight(kv, c.hidden_size, scale=3.0),
                    "v": weight(kv, c.hidden_size),
                    "o": weight(c.hidden_size, q),
                    "up": weight(4 * c.hidden_size, c.hidden_size),
                    "down": weight(c.hidden_size, 4 * c.hidden_size),
                }
            )
            for _ in range(c.num_layers)
        )

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward(self, input_ids, positions, kv, meta):
        c = self.config
        x = self.embed[input_ids] + self.pos[positions]
        for layer, store in zip(self.layers, kv):
            h = self._norm(x)
            q = (h @ layer["q"].T).view(-1, c.num_heads, c.head_dim)
            k = (h @ layer["k"].T).view(-1, c.num_kv_heads, c.head_dim)
            v = (h @ layer["v"].T).view(-1, c.num_kv_heads, c.head_dim)
            store.write(k, v, meta.slot_mapping, positions)
            attn = store.attend(q, meta, c.head_dim**-0.5)
            x = x + attn.reshape(len(x), -1) @ layer["o"].T
            x = x + torch.relu(self._norm(x) @ layer["up"].T) @ layer["down"].T
        return x

    def rope_inv_freq(self) -> torch.Tensor:
        return torch.zeros(self.config.head_dim // 2)  # learned positions, no RoPE: key offsets do not turn

    def set_logits_dtype(self, dtype: torch.dtype) -> int:
        self.logits_dtype = dtype
        return 0  # no copy: each call rounds the unembedding

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self._norm(hidden).to(self.logits_dtype) @ self.unembed.T.to(self.logits_dtype)).float()


@dataclass
class ToyLoaded:
    model: ToyModel
    config: ToyConfig = field(default_factory=ToyConfig)
    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)
    name: str = "toy"
    path: str = "<random weights>"
    raw_weights: dict = field(default_factory=dict)  # LoadedModel's raw file blocks: none here


def toy_loaded(seed: int = 0) -> ToyLoaded:
    config = ToyConfig()
    return ToyLoaded(model=ToyModel(config, seed), config=config)


# -- driving an engine from a test ---------------------------------------------------------
PAGE_SIZE = 4
BYTES_PER_PAGE = 2 * 2 * 2 * 8 * 4 * PAGE_SIZE  # layers * (K+V) * kv_heads * head_dim * f32 bytes * tokens


@dataclass
class Finished:
    """Everything one request streamed, joined."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None
    outputs: list  # the RequestOutputs, in order


def make_engine(loaded: ToyLoaded, num_pages: int = 512, **config) -> "Engine":
    from server.config import EngineConfig
    from server.runtime.engine import Engine

    config.setdefault("max_num_batched_tokens", 64)
    # On a CPU the engine launches nothing ahead unless asked; the tests ask, so that every engine test also runs
    # the steps scheduled ahead (test_async_scheduling.py checks the default).
    config.setdefault("async_scheduling", True)
    # The tests compare runs whose prompts are chunked differently (preemption, budgets): exactly, in float32. In
    # bfloat16 (the default on a CPU that multiplies it natively) each chunking rounds its own way.
    config.setdefault("cpu_prompt_dtype", "float32")
    config.setdefault("cpu_logits_dtype", "float32")
    engine = Engine(EngineConfig(kv_cache_memory=num_pages * BYTES_PER_PAGE, page_size=PAGE_SIZE, **config), loaded)
    engine.start()
    return engine


def assert_pages_return(engine: "Engine", timeout: float = 10.0) -> None:
    """Every page is free again. A request's final output can go out while a step launched
    ahead (async scheduling) still writes its pages; they return right after that step."""
    import time

    deadline = time.monotonic() + timeout
    while engine.kv_cache.num_free_pages != engine.kv_cache.num_pages and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.kv_cache.num_free_pages == engine.kv_cache.num_pages, (
        f"{engine.kv_cache.num_pages - engine.kv_cache.num_free_pages} pages still used {timeout}s after the last output"
    )


class Collector:
    """on_output callbacks for many requests; ``wait()`` until all have finished."""

    def __init__(self):
        import threading

        self.outputs: dict[str, list] = {}
        self._all_done = threading.Condition()

    def callback(self, request_id: str):
        self.outputs[request_id] = []

        def on_output(out):
            with self._all_done:
                self.outputs[request_id].append(out)
                self._all_done.notify_all()

        return on_output

    def wait(self, timeout: float = 60.0) -> dict[str, Finished]:
        with self._all_done:
            ok = self._all_done.wait_for(
                lambda: all(o and o[-1].finished for o in self.outputs.values()), timeout=timeout
            )
        unfinished = [k for k, o in self.outputs.items() if not (o and o[-1].finished)]
        assert ok, f"requests did not finish within {timeout}s: {unfinished}"
        for rid, outs in self.outputs.items():
            assert [o.finished for o in outs].count(True) == 1, f"{rid}: the final output must come exactly once"
        return {
            rid: Finished(
                token_ids=[t for o in outs for t in o.token_ids],
                text="".join(o.text for o in outs),
                finish_reason=outs[-1].finish_reason,
                error=outs[-1].error,
                outputs=outs,
            )
            for rid, outs in self.outputs.items()
        }


def run_all(engine, requests: dict[str, tuple[list[int], object]]) -> dict[str, Finished]:
    """Submit every (prompt, params) at once and wait for all of them."""
    collector = Collector()
    for rid, (prompt, params) in requests.items():
        engine.submit(rid, prompt, params, collector.callback(rid))
    return collector.wait()
