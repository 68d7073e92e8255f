"""KV memory families: how big the page pool is, how full, and what compression buys.

The pool shape is fixed at start-up (``on_pool``); usage moves every step (``on_pages_used``);
each finished request reports the bytes its pages held (``on_request_freed``).
"""

from __future__ import annotations

from prometheus_client import Gauge, Histogram

LABELS = ["model_name"]

# 64 KiB .. 64 GiB in factors of 4: one short chat to a long-context request of a large model.
REQUEST_BYTES_BUCKETS = [float(4**i * 1024) for i in range(3, 14)]

pool_pages = Gauge("turboserve_kv_pool_pages", "Pages in the KV pool (used + free).", LABELS)
pages_used = Gauge("turboserve_kv_pages_used", "Pages owned by sequences.", LABELS)
pages_free = Gauge("turboserve_kv_pages_free", "Pages available to new tokens.", LABELS)
pool_bytes = Gauge("turboserve_kv_pool_bytes", "Bytes of the KV pool, all layers.", LABELS)
bytes_used = Gauge("turboserve_kv_bytes_used", "Bytes of the pages owned by sequences.", LABELS)
# vLLM's name and meaning (fraction of the pool in use), so its dashboards' cache panels translate.
cache_usage = Gauge("turboserve_kv_cache_usage_perc", "KV pool usage: 1 means every page is owned.", LABELS)
value_bitwidth = Gauge(
    "turboserve_kv_value_bitwidth", "Storage bits per cached K or V element, norms included.",
    LABELS + ["kind", "dtype"],
)  # fmt: skip
token_bytes = Gauge("turboserve_kv_bytes_per_token", "KV bytes of one token, K and V of all layers.", LABELS)
pool_tokens = Gauge("turboserve_kv_pool_tokens", "Tokens that fit in the whole pool.", LABELS)
recent_tokens = Gauge(
    "turboserve_kv_recent_window_tokens", "Last tokens of each sequence a turbo cache also keeps unquantized.", LABELS
)
recent_bytes = Gauge(
    "turboserve_kv_recent_window_bytes", "Bytes of the recent-window rows, all layers (outside the page pool).", LABELS
)
compression_ratio = Gauge(
    "turboserve_kv_compression_ratio", "bf16 KV bytes per token divided by this pool's, same model.", LABELS
)
request_bytes = Histogram(
    "turboserve_kv_request_bytes", "KV bytes a request held when it finished (its pages).", LABELS,
    buckets=REQUEST_BYTES_BUCKETS,
)  # fmt: skip


class KVMetrics:
    """The KV families with the model_name label bound."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self._page_bytes = 0
        self._pages_total = 0
        self._used = pages_used.labels(model_name)
        self._free = pages_free.labels(model_name)
        self._bytes_used = bytes_used.labels(model_name)
        self._usage = cache_usage.labels(model_name)
        self._request_bytes = request_bytes.labels(model_name)

    def on_pool(
        self,
        *,
        num_pages: int,
        page_size: int,
        bytes_per_token: int,
        k_dtype: str,
        v_dtype: str,
        k_bits: float,
        v_bits: float,
        bf16_bytes_per_token: int,
        recent_window: int = 0,
        recent_window_bytes: int = 0,
    ) -> None:
        """The pool as allocated. Both byte counts cover K and V of every layer; the bf16 one
        is what the same model would need with a plain bf16 cache (the compression baseline). A turbo cache's
        recent window (kernels/turbo/recent.py) is reported beside the pool: its rows are not pages."""
        name = self.model_name
        self._pages_total = num_pages
        self._page_bytes = page_size * bytes_per_token
        pool_pages.labels(name).set(num_pages)
        pool_bytes.labels(name).set(num_pages * self._page_bytes)
        token_bytes.labels(name).set(bytes_per_token)
        pool_tokens.labels(name).set(num_pages * page_size)
        value_bitwidth.labels(name, "k", k_dtype).set(k_bits)
        value_bitwidth.labels(name, "v", v_dtype).set(v_bits)
        compression_ratio.labels(name).set(bf16_bytes_per_token / bytes_per_token)
        recent_tokens.labels(name).set(recent_window)
        recent_bytes.labels(name).set(recent_window_bytes)
        self.on_pages_used(0)

    def on_pages_used(self, used: int) -> None:
        """Pages owned by sequences right now (after a step, an abort, a preemption)."""
        self._used.set(used)
        self._free.set(self._pages_total - used)
        self._bytes_used.set(used * self._page_bytes)
        self._usage.set(used / self._pages_total if self._pages_total else 0.0)

    def on_request_freed(self, num_pages: int) -> None:
        """A finished request gave back ``num_pages`` pages."""
        self._request_bytes.observe(num_pages * self._page_bytes)
