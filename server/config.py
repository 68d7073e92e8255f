"""Configuration: one frozen dataclass per concern, built once by the CLI."""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "bf16", "f16", "f32", "turbo2", "turbo3", "turbo4")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_KEY_OFFSETS = ("fixed", "partial", "turned", "none")  # what a turbo K store subtracts (runtime/kv_calibration.py)
# partial on 8 pairs: turbo3 perplexity +6.9 % (fixed +15.3 %) and decode at 64K still above bf16's
# (docs/BENCHMARKS.md "Quality", "TurboQuant decode with a partial key offset")
DEFAULT_KV_KEY_OFFSET = "partial"
DEFAULT_KV_KEY_TURNED_PAIRS = 8  # partial's rotate-half pairs per KV head (all of them in heads with fewer)
# Turbo caches also keep each sequence's last 128 tokens unquantized (kernels/turbo/recent.py): on the embedded
# model turbo3's perplexity loss +5.3 % -> +0.4 %, turbo4's +1.4 % -> +0.04 % (docs/BENCHMARKS.md "Quality")
DEFAULT_KV_RECENT_WINDOW = 128


@dataclass(frozen=True)
class EngineConfig:
    """Everything the runtime needs to load a model and schedule requests."""

    model: str | None = None  # GGUF file or HF directory; None means the embedded SmolLM2
    served_model_name: str | None = None  # defaults to the model's own name
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # compute dtype of weights and activations
    kv_cache_dtype: str = "auto"  # storage of K and V unless overridden below
    kv_cache_dtype_k: str | None = None
    kv_cache_dtype_v: str | None = None
    kv_cache_memory: int | None = None  # bytes for the page pool; None: a fraction of free memory
    kv_key_offset: str = DEFAULT_KV_KEY_OFFSET  # one of KV_KEY_OFFSETS
    kv_key_turned_pairs: int | None = None  # partial: pairs per KV head that turn (None: DEFAULT_KV_KEY_TURNED_PAIRS)
    kv_balance: bool = True  # fold turbo K / V channel scales into the attention weights (runtime/kv_balance.py)
    kv_recent_window: int = DEFAULT_KV_RECENT_WINDOW  # turbo: last tokens of each sequence read unquantized; 0 off
    page_size: int = 16  # tokens per KV page
    max_model_len: int | None = None  # defaults to the model's context length
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 2048  # token budget of one engine step
    max_queue: int = 256  # waiting requests beyond which submit() refuses
    seed: int = 0
    enforce_eager: bool = False  # disable CUDA graphs
    # On a CPU, multiply a GGUF's Q4_0 / Q4_1 projections as stored (runtime/models/int4_weights.py), not
    # dequantized, and prompt chunks through a bf16 copy where cpu_prompt_dtype says; in a model the engine loads
    # itself (one handed to it keeps its float weights)
    cpu_int4: bool = True
    # What a CPU multiplies prompt chunks in (their attention and the 4-bit projections' GEMMs): "float32", or
    # "bfloat16" (inputs rounded, float32 sums); "auto": bfloat16 where the CPU multiplies it natively (AMX tiles or
    # AVX512-BF16: 4-5x the float32 GEMM)
    cpu_prompt_dtype: str = "auto"
    # What a CPU multiplies the LM head in, the same choices: bfloat16 keeps a copy of the head and halves the bytes
    # its GEMV streams each decode step
    cpu_logits_dtype: str = "auto"
    # Launch the next step before reading this one's tokens back. None: where kernels run behind the host (CUDA);
    # on a CPU the launch is the computation, and running the next step first only delays this one's tokens.
    async_scheduling: bool | None = None
    kernel_timing_sample_rate: float = 0.01  # fraction of steps whose kernels are timed; 0 disables


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    log_level: str = "info"
    max_body_bytes: int = 4 * 1024 * 1024
    allowed_origins: tuple[str, ...] = ()  # web origins whose pages may call the API (CORS); "*" any; () none
