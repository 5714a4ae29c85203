"""`--dummy-weights`: full-size models with random weights, made on the device, for speed work.

    model = load_dummy("qwen3-30b-a3b", "q4_k", layers=2, dtype=torch.bfloat16, device="cuda")

`model` is a built-in configuration (`BUILTIN`, HF config.json fields) or a real GGUF file / HF
directory, of which only the configuration is read. The weights come from `DummySource`, a
weight source like the GGUF and safetensors ones, run through the strict loader: the model is
built from the same `QuantWeight`, `Linear` and `ExpertBank` objects as a real checkpoint's and
runs the same kernels. Storage is the format's real layout with valid blocks (finite fp16
d / dmin of Q4_K and Q8_0, E8M0 exponents of MXFP4 that are not NaN, NVFP4 E4M3 block scales
plus an fp32 second-level scale per matrix and per expert), drawn on `device` directly.

Which format each weight gets (the layout of a llama.cpp file of that shape; the GGUF that
scripts/make_random_gguf.py writes has the same):
- routed experts, shared experts and dense MLPs: the chosen format;
- attention and linear-attention projections, embeddings, lm_head: Q8_0 (bf16 for `bf16`);
- routers, norms and other vectors: float.
A matrix whose input size is not a multiple of the format's block falls back to Q8_0 (a Q4_K
super-block is 256 values: Gemma-4's 704-wide expert down projection), then to bf16.
Values are scaled like a trained model's (about 0.02, the same spread in every format), so
activations stay finite for many layers. Prompts are token ids: `IdTokenizer` stands in for a
tokenizer.

Routing. The expert-cache ceilings assume uniform routing (each token's top-k spread evenly
over the experts, independently across tokens and steps), so the routers must see hidden
states that differ from token to token. Two things break that in a random model:
- attention averages values over the prefix, so its output is nearly the same vector for
  every later token; through v_proj and o_proj at 0.02 that common part comes back about 1.2x
  as large each layer (normed input of rms 1: 0.02 sqrt(2048) * 0.02 sqrt(4096)), and by
  layer 8 of Qwen3-30B-A3B every token routes alike (benchmarks/dummy_routing.py). Hence
  OUT_STD = STD / 8 for o_proj / out_proj: the common part of the routers' input stays near
  that of independent random vectors (about 0.1 of its norm over 24 layers, 1.0 at 0.02).
  (Gemma normalises each block's output after the fact: there it changes nothing.)
- embedding rows of 0.02 are small next to what the layers add: the token's identity is lost.
  Hence rows of rms EMBED_RMS (1, as gemma's scaled embedding already has).
Also the formats' spreads agree (Q4_K's was 2.7x the others': its experts' outputs were 20x
louder and drowned the common part, which is why Q4_K alone looked uniform).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import replace
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from freetoken.formats.qweight import QuantWeight
from freetoken.layers.embedding import Embedding
from freetoken.layers.linear import Linear
from freetoken.layers.moe import FusedExperts, Vector
from freetoken.layers.norm import RMSNorm
from freetoken.models.config import ModelConfig, from_hf

logger = logging.getLogger(__name__)
T = GGMLQuantizationType
STD = 0.02  # weight spread of a trained model's matrices
EMBED_RMS = 1.0  # embedding rows (after gemma's sqrt(hidden)): the token's own signal
OUT_STD = STD / 8  # attention's output projections (o_proj, the delta-net's out_proj)

_QWEN3_MOE = dict(model_type="qwen3_moe", rms_norm_eps=1e-6, rope_theta=1e6,
                  norm_topk_prob=True, tie_word_embeddings=False)
# HF config.json fields. Full-size shapes: FACTS.md and transformers' config defaults.
BUILTIN: dict[str, dict] = {
    "qwen3-30b-a3b": dict(
        _QWEN3_MOE, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, bos_token_id=151643, eos_token_id=151645),
    # qwen3.5-moe: 3 gated delta-net layers to 1 full-attention layer, partial rotary.
    "qwen3.6-35b-a3b": dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048,
        num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        max_position_embeddings=262144, rms_norm_eps=1e-6, rope_theta=1e7,
        partial_rotary_factor=0.25, full_attention_interval=4, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512,
        tie_word_embeddings=False),
    # NOTE: the published model shares K and V on its full layers (attention_k_eq_v, 2 KV
    # heads there); FreeToken's gemma4 file refuses k_eq_v, so every layer has 8 KV heads.
    "gemma-4-26b-a4b": dict(
        model_type="gemma4_text", vocab_size=262144, hidden_size=2816, intermediate_size=2112,
        num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        global_head_dim=512, max_position_embeddings=262144, rms_norm_eps=1e-6,
        sliding_window=1024, hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=30.0, enable_moe_block=True, num_experts=128, top_k_experts=8,
        moe_intermediate_size=704, tie_word_embeddings=True,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
        rope_parameters={"full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                            "partial_rotary_factor": 0.25},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # Small ones for tests: input sizes multiples of 256, so Q4_K covers every matrix.
    "tiny-qwen3-moe": dict(
        _QWEN3_MOE, vocab_size=1024, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=256),
    "tiny-llama": dict(
        model_type="llama", vocab_size=1024, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=5e5,
        tie_word_embeddings=False),
}

# format -> (QuantWeight fmt, ggml type or None, values per block)
FORMATS = {"bf16": ("bf16", None, 1), "q8_0": ("gguf", T.Q8_0, 32), "q4_k": ("gguf", T.Q4_K, 256),
           "mxfp4": ("gguf", T.MXFP4, 32), "nvfp4": ("nvfp4", None, 16)}


# ---- configuration ---------------------------------------------------------------------------
def dummy_config(model: str | os.PathLike | None, layers: int | None = None) -> ModelConfig:
    """The ModelConfig of a built-in name or of a real GGUF / HF directory, shortened."""
    if model is None:
        raise ValueError("--dummy-weights needs --model: a built-in configuration "
                         f"({', '.join(BUILTIN)}) or a GGUF file / HF directory")
    key = os.fspath(model)
    if key in BUILTIN:
        cfg = from_hf(json.loads(json.dumps(BUILTIN[key])), path=f"<built-in {key}>")
    else:
        cfg = _config_of_path(Path(key).expanduser())
    return cfg if layers is None else shorten(cfg, layers)


def _config_of_path(p: Path) -> ModelConfig:
    from freetoken.models import _open_gguf, _open_hf

    if not p.exists():
        raise ValueError(f"--model {str(p)!r} is neither a built-in configuration "
                         f"({', '.join(BUILTIN)}) nor a file or directory")
    return (_open_hf(p) if p.is_dir() else _open_gguf(p))[0]


def shorten(cfg: ModelConfig, layers: int) -> ModelConfig:
    """The first `layers` layers; the last becomes full attention if none is (so that a
    hybrid or sliding-window model keeps a KV cache and a global layer)."""
    if not 1 <= layers <= cfg.num_layers:
        raise ValueError(f"--dummy-layers must be in [1, {cfg.num_layers}], got {layers}")
    types = list(cfg.layer_types[:layers])
    if types and "full" not in types:
        types[-1] = "full"
    return replace(cfg, num_layers=layers, layer_types=tuple(types),
                   mlp_only_layers=tuple(i for i in cfg.mlp_only_layers if i < layers))


# ---- random weights in each format's storage --------------------------------------------------
class Rand:
    """Random tensors on one device from one seeded generator."""

    def __init__(self, device, seed: int):
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.host = torch.Generator().manual_seed(seed)  # scalars kept on the host

    def normal(self, shape, std: float, dtype=torch.float32) -> torch.Tensor:
        return (torch.randn(shape, device=self.device, generator=self.gen) * std).to(dtype)

    def uniform(self, shape, lo: float, hi: float) -> torch.Tensor:
        u = torch.rand(shape, device=self.device, generator=self.gen)
        return lo + (hi - lo) * u

    def bytes(self, shape, lo: int = 0, hi: int = 256) -> torch.Tensor:
        if (lo, hi) != (0, 256) or self.device.type != "cpu":
            return torch.randint(lo, hi, shape, dtype=torch.uint8, device=self.device,
                                 generator=self.gen)
        # CPU: uniform bytes 8 at a time (the generator's cost is per element drawn: 4x faster).
        n = math.prod(shape)
        words = torch.randint(-2**63, 2**63 - 1, (-(-n // 8),), dtype=torch.int64,
                              device=self.device, generator=self.gen)
        return words.view(torch.uint8)[:n].reshape(shape)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp16 values [..., 1] as their two little-endian bytes [..., 2]."""
    return x.to(torch.float16).view(torch.uint8)


def _gguf_blocks(r: Rand, qtype: T, rows: int, cols: int, std: float = STD) -> torch.Tensor:
    """uint8 [rows, row_bytes] of valid blocks: random codes, finite scales, values of spread
    about `std` (the constants: the decoded spread measured per unit of scale)."""
    block, size = GGML_QUANT_SIZES[qtype]
    b = r.bytes((rows, cols // block, size))
    if qtype == T.Q8_0:  # d (fp16) then 32 int8: values d * q, |q| <= 128, rms of q ~74
        b[..., 0:2] = _f16_bytes(r.uniform((*b.shape[:2], 1), 0.5, 1.5) * std / 74)
    elif qtype == T.Q4_K:  # d, dmin (fp16), 12 bytes of 6-bit scales / mins, 128 code bytes
        # value = d * sc * q - dmin * m: rms ~265 d for random sc, m, q. 0.02: d in
        # [6.4e-5, 9.4e-5], above fp16's smallest normal (6.1e-5): no subnormal scales
        d = r.uniform((*b.shape[:2], 1), 0.85, 1.25) * std / 265
        b[..., 0:2] = _f16_bytes(d)
        # mean sc = mean m and mean q = 7.5: zero mean on average
        b[..., 2:4] = _f16_bytes(7.5 * d)
    elif qtype == T.MXFP4:  # one E8M0 exponent (255 = NaN): 2^(e - 128) * (doubled E2M1)
        shift = round(math.log2(std / STD))  # 118..121: spread ~0.026 (powers of two only)
        b[..., 0] = r.bytes(b.shape[:2], 118 + shift, 122 + shift)
    else:
        raise ValueError(f"no random block maker for {qtype.name}")
    return b.reshape(rows, -1)


def _nvfp4(r: Rand, rows: int, cols: int, std: float = STD
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt NVFP4: codes [rows, cols/2], E4M3 scales in [0.5, 4) [rows, cols/16], and an
    fp32 second-level scale (kept on the host like a loader's, tiny)."""
    codes = r.bytes((rows, cols // 2))
    scales = r.bytes((rows, cols // 16), 0x30, 0x48).view(torch.float8_e4m3fn)
    # E2M1 rms ~2.9 times scales rms ~2.2: spread ~6.3 s2 (0.02: s2 ~0.0032)
    s2 = torch.empty(()).uniform_(0.8, 1.2, generator=r.host) * std / 6.3
    return codes, scales, s2


def random_weight(r: Rand, fmt: str, out: int, inp: int, name: str = "",
                  std: float = STD) -> QuantWeight:
    """One `[out, in]` weight in `fmt` (a key of FORMATS, or "f32"), on r's device, its
    values of spread about `std` in every format."""
    if fmt == "f32":
        return QuantWeight(r.normal((out, inp), std), "f32", (out, inp), source=name)
    kind, qtype, block = FORMATS[fmt]
    if inp % block:
        return random_weight(r, "q8_0" if inp % 32 == 0 else "bf16", out, inp, name, std)
    if kind == "bf16":
        return QuantWeight(r.normal((out, inp), std, torch.bfloat16), "bf16", (out, inp),
                           source=name)
    if kind == "nvfp4":
        codes, scales, s2 = _nvfp4(r, out, inp, std)
        return QuantWeight(codes, "nvfp4", (out, inp), scales=scales, scale2=s2, source=name)
    return QuantWeight(_gguf_blocks(r, qtype, out, inp, std), "gguf", (out, inp),
                       ggml_type=int(qtype), source=name)


# ---- the weight source ------------------------------------------------------------------------
def _role(prefix: str) -> str:
    """"ffn" (the chosen format), "float" (routers) or "other" (Q8_0) for a weight's name."""
    if ".experts." in prefix or ".mlp." in prefix and not prefix.endswith(
            (".mlp.gate", "shared_expert_gate")):
        return "ffn"
    if prefix.endswith((".mlp.gate", ".router.proj", "shared_expert_gate")):
        return "float"
    return "other"


class DummySource:
    """A weight source (models/sources.py) whose tensors are drawn when the loader asks.

    HF naming (`kind = "hf"`); every name a module of `model` asks for exists, with the shape
    the module expects, so the loader's strict checks pass and nothing is left over.
    """

    kind = "hf"

    def __init__(self, model, fmt: str, device, seed: int = 0, expert_device=None):
        if fmt not in FORMATS:
            raise ValueError(f"--dummy-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        self.fmt, self.path = fmt, f"<dummy {fmt} weights>"
        self.rand = Rand(device, seed)
        self.expert_rand = self.rand if expert_device is None else Rand(expert_device, seed + 1)
        self.shapes: dict[str, tuple[tuple[int, ...], object]] = {}
        from freetoken.models.loader import targets

        for t in targets(model):
            self._add(t.hf_prefix, t.module, t.part)

    def _add(self, prefix: str, mod, part: str) -> None:
        if isinstance(mod, Linear):
            self.shapes[prefix + ".weight"] = ((mod.parts[part], mod.in_features), mod)
            if mod.has_bias:
                self.shapes[prefix + ".bias"] = ((mod.parts[part],), mod)
        elif isinstance(mod, RMSNorm):
            self.shapes[prefix + ".weight"] = ((mod.dim,), mod)
        elif isinstance(mod, Embedding):
            self.shapes[prefix + ".weight"] = ((mod.vocab_size, mod.hidden_size), mod)
        elif isinstance(mod, FusedExperts):
            s = mod.spec
            gate, up, down = mod.part_names
            for e in range(s.num_experts):
                for p, shape in ((gate, (s.intermediate, s.hidden_size)),
                                 (up, (s.intermediate, s.hidden_size)),
                                 (down, (s.hidden_size, s.intermediate))):
                    self.shapes[f"{prefix}.{e}.{p}.weight"] = (shape, mod)
        elif isinstance(mod, Vector):
            self.shapes[prefix] = (tuple(mod.value.shape), mod)

    def names(self) -> set[str]:
        return set(self.shapes)

    def key(self, hf_prefix: str) -> str | None:
        return hf_prefix

    def tensor(self, name: str) -> torch.Tensor:
        """Norm weights, biases and vectors: small random values around the module's own
        default (1 for a norm, 0 for a `1 + w` norm and biases)."""
        shape, mod = self.shapes[name]
        if isinstance(mod, Vector):
            base = mod.value.float().to(self.rand.device)
        elif isinstance(mod, RMSNorm) and not mod.plus_one:
            base = torch.ones(shape, device=self.rand.device)
        else:
            base = torch.zeros(shape, device=self.rand.device)
        return base + self.rand.normal(shape, 0.1 if isinstance(mod, RMSNorm) else STD)

    def weight(self, prefix: str) -> tuple[QuantWeight, list[str]]:
        name = prefix + ".weight"
        (out, inp), _ = self.shapes[name]
        role = _role(prefix)
        fmt = self.fmt if role == "ffn" or self.fmt == "bf16" else "q8_0"
        rand = self.expert_rand if ".experts." in prefix else self.rand
        return random_weight(rand, "f32" if role == "float" else fmt, out, inp, name,
                             self._std(prefix)), [name]

    def _std(self, prefix: str) -> float:
        """The spread of a matrix's values (see "Routing" in the module docstring)."""
        _, mod = self.shapes[prefix + ".weight"]
        if isinstance(mod, Embedding):  # rows of rms EMBED_RMS after the model's scale
            return EMBED_RMS / mod.scale
        return OUT_STD if prefix.endswith((".o_proj", ".out_proj")) else STD


def load_dummy(model: str | os.PathLike | None, fmt: str = "bf16", layers: int | None = None,
               *, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0,
               show_progress: bool = True, expert_device=None):
    """A CausalLM of `model`'s configuration with random `fmt` weights made on `device`
    (routed experts on `expert_device` when given)."""
    from freetoken.models.loader import load_weights
    from freetoken.models.registry import build_model

    cfg = dummy_config(model, layers)
    net = build_model(cfg)
    src = DummySource(net, fmt, device, seed, expert_device)
    load_weights(net, src, dtype=dtype, device=device,
                 show_progress=show_progress)
    logger.info("dummy %s model %s: %d layers, random %s weights on %s", cfg.arch, model,
                cfg.num_layers, fmt, device)
    return net.eval()


# ---- a tokenizer stand-in ---------------------------------------------------------------------
class IdTokenizer:
    """Token ids in, token ids out, for models without a tokenizer (dummy weights).

    `encode("12 7 99")` reads whitespace-separated ids; other text becomes its UTF-8 bytes
    (ids 0-255). `decode` writes " <id>" per token, so streaming still shows progress.
    """

    model_family = "dummy"
    chat_template = None
    has_chat_template = False
    bos_token_id = None

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...] = ()):
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(i for i in eos_token_ids if 0 <= i < vocab_size)
        self.all_special_ids: set[int] = set()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        words = text.split()
        if words and all(w.isdigit() for w in words):
            return [int(w) for w in words]
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" {i}" for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [str(i) for i in ids]

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, **kw) -> str:
        raise ValueError("a --dummy-weights model has no chat template: send token ids as a "
                         "plain completion (/v1/completions, ft generate --no-chat)")

    def encode_chat(self, messages, **kwargs) -> list[int]:
        return self.encode(self.apply_chat_template(messages, **kwargs))


# ---- the engine's hook -------------------------------------------------------------------------
def check_dummy_flags(config) -> bool:
    """Whether `config` (EngineConfig) asks for dummy weights; ValueError where a --dummy-*
    flag is given without --dummy-weights (it would do nothing)."""
    if config.dummy_weights:
        return True
    if config.dummy_format != "bf16":
        raise ValueError("--dummy-format needs --dummy-weights (real checkpoints keep their "
                         "own formats)")
    if config.dummy_layers is not None:
        raise ValueError("--dummy-layers needs --dummy-weights (a real checkpoint keeps all "
                         "its layers)")
    return False


def load_dummy_engine_model(config, dtype: torch.dtype, device, tokenizer=None,
                            experts_on_host: bool = False):
    """(model, tokenizer) for the engine: the given tokenizer, `--tokenizer DIR`, or ids.

    `experts_on_host`: routed experts are drawn in host memory (the offload, hybrid and cpu
    backends' banks live there; the caller holds `layers.moe.host_banks`). NOTE: with
    `--moe-backend auto` they are made on the device, so auto's fit check sees them resident.
    """
    model = load_dummy(config.model, config.dummy_format, config.dummy_layers, dtype=dtype,
                       device=device, seed=config.seed, show_progress=config.show_progress,
                       expert_device="cpu" if experts_on_host else None)
    if tokenizer is None and config.tokenizer is not None:
        from freetoken.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_path(config.tokenizer, chat_template_file=config.chat_template)
    if tokenizer is None:
        tokenizer = IdTokenizer(model.config.vocab_size, model.config.eos_token_ids)
    return model, tokenizer
