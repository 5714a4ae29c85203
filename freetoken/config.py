"""Configuration as frozen dataclasses; argparse (cli.py) takes its defaults from the fields."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

DTYPES = ("auto", "float32", "bfloat16", "float16")
CACHE_TYPES = ("radix", "naive")
MOE_BACKENDS = ("auto", "fused", "offload", "hybrid", "cpu")
DUMMY_FORMATS = ("bf16", "q4_k", "q8_0", "nvfp4", "mxfp4")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load a model and schedule requests."""

    model: str | None = None  # path (GGUF file or HF dir) or packaged name; None = default
    dtype: str = "auto"  # activation / dense-weight dtype; auto = float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto = cuda if available else cpu
    max_model_len: int | None = None  # None = the model's context length (capped, see engine)
    max_running_requests: int = 32
    max_prefill_tokens: int = 2048  # chunked prefill: tokens per step across requests
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # None = sized from kv_cache_mb
    kv_cache_mb: int = 512
    cache_type: str = "radix"  # radix: prefix reuse; naive: none
    seed: int = 0
    tokenizer: str | None = None  # HF dir overriding the model's own tokenizer
    chat_template: str | None = None  # a Jinja file overriding the model's template
    # auto: fused when every expert fits on the device, else from the ft bench bw profile
    moe_backend: str = "auto"
    moe_cache_size: int | None = None  # slots of the expert cache (offload / hybrid / cpu)
    moe_cache_rate: float | None = None  # or: a fraction of all routed experts
    moe_hybrid_max_fetch: int | None = None  # per layer call; 0 = every miss to the CPU,
    # None / -1 = from the profile
    # offload / hybrid: per layer call, up to N of the next MoE layer's predicted misses are
    # fetched ahead of it; None = moe/ahead.py's FETCH_AHEAD where the backend fetches
    # (not cpu, not a fetch cap of 0)
    moe_fetch_ahead: int | None = None
    moe_cpu_threads: int | None = None  # None = physical cores minus one
    # prefill calls stream whole expert banks (moe/prefill_stream.py): the experts the slot
    # cache holds are copied from their slots instead of over PCIe
    moe_prefill_hit_d2d: bool = False
    disable_moe_prefill_overlap: bool = False  # one buffer: copy a layer, wait, compute
    dummy_weights: bool = False  # random weights made on the device (performance work)
    dummy_format: str = "bf16"  # weight format of --dummy-weights models
    dummy_layers: int | None = None  # shorten a --dummy-weights model to N layers
    cuda_graph_max_bs: int | None = None  # largest decode batch captured; None = max running
    disable_cuda_graph: bool = False
    # decode steps overlap (CUDA): the next step is launched from the device's sampled ids
    # before the host reads them and does the previous step's bookkeeping (engine/engine.py)
    disable_overlap_schedule: bool = False
    decode_log_interval: int = 40  # a decode log line every N decode steps (0 = none)
    show_progress: bool = True

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("cache_type", self.cache_type, CACHE_TYPES)
        _check_choice("moe_backend", self.moe_backend, MOE_BACKENDS)
        _check_choice("dummy_format", self.dummy_format, DUMMY_FORMATS)
        if self.moe_fetch_ahead is not None and self.moe_fetch_ahead < 0:
            raise ValueError(f"moe_fetch_ahead must be 0 (off) or a positive number of experts, "
                             f"got {self.moe_fetch_ahead}")
        for name in ("max_running_requests", "max_prefill_tokens", "page_size", "kv_cache_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 1919
    served_model_name: str | None = None
    api_key: str | None = None
    reasoning_parser: str | None = None  # None = chosen from the model family
    tool_call_parser: str | None = None
    max_in_flight_requests: int = 256  # HTTP generation requests held at once; more get 503
    max_body_mb: int = 8  # larger request bodies get 413
    # What one request may ask for (more is a 400 naming the field): see serving.RequestLimits.
    max_n: int = 8  # choices per request (`n`); OpenAI allows 128
    max_logprobs: int = 20  # logprobs / top_logprobs alternatives per token
    max_stop: int = 16  # stop strings per request
    max_tools: int = 128  # tool definitions per request
    max_stored_responses: int = 256  # /v1/responses kept for GET and previous_response_id


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
