# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Engine configuration: one dataclass per concern, validated on construction."""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.model_executor.layers.quantization import QuantizationConfig

logger = init_logger(__name__)

_DTYPES = {"auto", "float32", "float", "float16", "half", "bfloat16"}
DEFAULT_MODEL_DIR = Path(__file__).parent / "model_zoo" / "tiny-deepseek-mtp"


def get_attr_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a class: field name -> the string literal right below it."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef), cls
    body = node.body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def default_model_path() -> str:
    """The bundled default model (used when no model is given)."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise ValueError(
            f"no model given and the bundled default model is missing at {DEFAULT_MODEL_DIR}"
        )
    return str(DEFAULT_MODEL_DIR)


def load_hf_config(model: str, trust_remote_code: bool = False) -> Any:
    """Read config.json of a local HF folder into a transformers config object."""
    path = Path(model)
    if not path.exists():
        raise ValueError(f"model path {model!r} does not exist (models load from local folders)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"model path {model!r} has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"config.json of {model!r} is unreadable: {e}") from e
    from transformers import AutoConfig, PretrainedConfig

    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as e:
        # A model_type transformers does not know: keep the raw fields, the registry decides.
        logger.debug("AutoConfig failed for %s (%s); using the raw config", model, e)
        return PretrainedConfig(**raw)


def get_text_config(hf_config: Any) -> Any:
    """The language-model part of a (possibly multimodal) config."""
    getter = getattr(hf_config, "get_text_config", None)
    return getter() if getter is not None else hf_config


def _config_dtype(hf_config: Any) -> str | None:
    for name in ("dtype", "torch_dtype"):
        v = getattr(hf_config, name, None)
        if v is not None:
            return str(v).replace("torch.", "")
    return None


@dataclass
class ModelConfig:
    """What model to run and in which dtype."""

    model: str = ""
    """Local folder of an HF-format checkpoint."""
    tokenizer: str | None = None
    """Tokenizer folder; defaults to the model folder."""
    dtype: str = "auto"
    """auto | float32 | float16 | bfloat16; auto takes the checkpoint's (fp16 -> bf16 on CPU)."""
    seed: int = 0
    """Seed for requests without their own seed."""
    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's max_position_embeddings."""
    trust_remote_code: bool = False
    """Passed to transformers when reading the config/tokenizer."""
    served_model_name: str | list[str] | None = None
    """Name(s) the server answers to and labels metrics with; defaults to the model path."""
    quantization: str | None = None
    """Weight quantization (vLLM's --quantization): None takes the checkpoint's
    quantization_config; 'fp8' = block-quantized e4m3 weights as DeepSeek / Qwen publish them."""
    hf_config: Any = field(default=None, repr=False)
    """The checkpoint's config (filled in __post_init__)."""

    def __post_init__(self) -> None:
        if not self.model:
            self.model = default_model_path()
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.hf_config is None:
            self.hf_config = load_hf_config(self.model, self.trust_remote_code)
        # Parsed here so a checkpoint we cannot run fails at construction, naming the field.
        self.quantization = self._resolve_quantization()[0]
        text = self.hf_text_config
        max_pos = getattr(text, "max_position_embeddings", None) or 2048
        if self.max_model_len is None:
            self.max_model_len = int(max_pos)
        elif not isinstance(self.max_model_len, int) or self.max_model_len < 1:
            raise ValueError(
                f"max_model_len must be a positive integer, got {self.max_model_len!r}"
            )
        elif self.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={max_pos}"
            )

    @property
    def served_model_names(self) -> list[str]:
        """served_model_name as a list (the first is the reported one), else [model]."""
        names = self.served_model_name
        if isinstance(names, str):
            names = [names]
        return list(names) if names else [self.model]

    @property
    def hf_text_config(self) -> Any:
        return get_text_config(self.hf_config)

    def _resolve_quantization(self) -> tuple[str | None, QuantizationConfig | None]:
        from vllm.model_executor.layers.quantization import resolve_quantization

        return resolve_quantization(self.quantization, self.hf_config, self.model)

    def get_quant_config(self) -> QuantizationConfig | None:
        """The parsed QuantizationConfig the model is built with, or None (unquantized)."""
        return self._resolve_quantization()[1]

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"config.json of {self.model!r} names no architectures")
        return archs[0]

    def torch_dtype(self, device_type: str):
        import torch

        name = self.dtype
        if name == "auto":
            name = _config_dtype(self.hf_config) or "float32"
            if name in ("float16", "half") and device_type == "cpu":
                name = "bfloat16"  # fp16 matmuls are slow on CPUs
        return {
            "float32": torch.float32,
            "float": torch.float32,
            "float16": torch.float16,
            "half": torch.float16,
            "bfloat16": torch.bfloat16,
        }[name]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_text_config.vocab_size)

    @property
    def is_hybrid(self) -> bool:
        """Whether the model mixes attention with linear-attention (per-request state) layers."""
        from vllm.model_executor.models.registry import resolve_model_cls

        return bool(getattr(resolve_model_cls(self.architecture), "is_hybrid", False))

    @property
    def num_hidden_layers(self) -> int:
        return int(self.hf_text_config.num_hidden_layers)


@dataclass
class CacheConfig:
    """Paged KV cache settings."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_bytes: int | None = None
    """Bytes for the KV cache; overrides gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory the engine may use on CUDA."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV blocks of shared prompt prefixes across requests. None (the default): on,
    except for hybrid models (linear-attention states are per request, not per block), where it
    is off; True on a hybrid model is an error."""
    num_gpu_blocks: int | None = None
    """Number of KV blocks (derived from the memory budget by the worker)."""
    num_gpu_blocks_override: int | None = None
    """Use this many KV blocks instead of what the memory budget gives (testing, tuning)."""

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.num_gpu_blocks_override is not None and (
            not isinstance(self.num_gpu_blocks_override, int) or self.num_gpu_blocks_override < 1
        ):
            raise ValueError(
                "num_gpu_blocks_override must be a positive integer, got "
                f"{self.num_gpu_blocks_override!r}"
            )
        if not (self.enable_prefix_caching is None or isinstance(self.enable_prefix_caching, bool)):
            raise ValueError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )


@dataclass
class SchedulerConfig:
    """Batching limits."""

    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps."""
    max_model_len: int = 2048
    """Copied from ModelConfig."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")


DistributedExecutorBackend = Literal["mp", "ray", "uni"]


@dataclass
class ParallelConfig:
    """How the model is split across processes."""

    pipeline_parallel_size: int = 1
    """Number of pipeline stages (one process / Ray actor each)."""
    tensor_parallel_size: int = 1
    """Tensor parallelism (not built: must be 1)."""
    distributed_executor_backend: DistributedExecutorBackend | None = None
    """mp (one process per stage) | ray (one Ray actor per stage) | uni (in this process);
    None picks uni for P = 1 and mp otherwise."""

    def __post_init__(self) -> None:
        p = self.pipeline_parallel_size
        if not isinstance(p, int) or p < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive integer, got {p!r}")
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} is not supported "
                "(only 1; use pipeline_parallel_size to split a model)"
            )
        backend = self.distributed_executor_backend
        if backend is not None and backend not in get_args(DistributedExecutorBackend):
            raise ValueError(
                f"distributed_executor_backend must be 'mp', 'ray' or 'uni', got {backend!r}"
            )
        if backend is None:
            self.distributed_executor_backend = "uni" if p == 1 else "mp"
        elif backend == "uni" and p > 1:
            raise ValueError("distributed_executor_backend='uni' needs pipeline_parallel_size=1")

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size


SPEC_METHODS = ("mtp", "eagle", "eagle3")
# Target architecture -> the architecture of its in-checkpoint MTP draft.
MTP_DRAFT_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "DeepSeekMTPModel",
    "DeepseekV3ForCausalLM": "DeepSeekMTPModel",
    # model_type deepseek_v32 / glm_moe_dsa: MTP layers with their own DSA indexer.
    "DeepseekV32ForCausalLM": "DeepseekV32MTP",
    "GlmMoeDsaForCausalLM": "DeepseekV32MTP",
    "Qwen3_5ForCausalLM": "Qwen3_5MTP",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5MTP",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeMTP",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeMTP",
}


def num_mtp_layers(hf_text_config: Any) -> int:
    """MTP layers a checkpoint ships (DeepSeek num_nextn_predict_layers, Qwen3.5
    mtp_num_hidden_layers)."""
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        v = getattr(hf_text_config, key, None)
        if v:
            return int(v)
    return 0


_METHOD_ALIASES = {
    "deepseek_mtp": "mtp",
    "qwen3_5_mtp": "mtp",
    "qwen3_next_mtp": "mtp",
    "mimo_mtp": "mtp",
    "ernie_mtp": "mtp",
    "glm4_moe_mtp": "mtp",
}
_SPEC_KEYS = {
    "method",
    "num_speculative_tokens",
    "model",
    "draft_sample_method",
    "max_model_len",
    "draft_tensor_parallel_size",
    "quantization",
    "revision",
}


@dataclass
class SpeculativeConfig:
    """Speculative decoding: which drafter and how many tokens it proposes per step."""

    method: str = "mtp"
    """mtp | eagle | eagle3 (deepseek_mtp, qwen3_5_mtp ... map to mtp)."""
    num_speculative_tokens: int = 1
    """K: draft tokens proposed per step."""
    model: str | None = None
    """Draft checkpoint folder; for mtp defaults to the target checkpoint."""
    draft_sample_method: str = "greedy"
    """greedy | probabilistic: how the draft picks its tokens."""
    draft_model_config: Any = field(default=None, repr=False)
    """The draft's ModelConfig (filled by VllmConfig)."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        unknown = set(d) - _SPEC_KEYS
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {sorted(unknown)}; "
                f"known: {sorted(_SPEC_KEYS)}"
            )
        if "method" not in d:
            raise ValueError("speculative_config.method is required (e.g. 'mtp' or 'eagle3')")
        keep = {
            k: d.get(k)
            for k in ("method", "num_speculative_tokens", "model", "draft_sample_method")
        }
        keep = {k: v for k, v in keep.items() if v is not None}
        if d.get("draft_tensor_parallel_size") not in (None, 1):
            raise ValueError("speculative_config.draft_tensor_parallel_size must be 1")
        return cls(**keep)

    def __post_init__(self) -> None:
        if not isinstance(self.method, str):
            raise ValueError(f"speculative_config.method must be a string, got {self.method!r}")
        self.method = _METHOD_ALIASES.get(self.method, self.method)
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method {self.method!r} is not supported; "
                f"choose one of {list(SPEC_METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}"
            )
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(
                "speculative_config.draft_sample_method must be 'greedy' or 'probabilistic', "
                f"got {self.draft_sample_method!r}"
            )
        if self.method in ("eagle", "eagle3") and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r}")

    @property
    def use_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3")

    @property
    def num_lookahead_tokens(self) -> int:
        """How many tokens after a position the draft's KV at that position depends on: 1 for
        a draft that reads the next token there (EAGLE, one MTP layer); with n chained MTP
        layers, layer s at position t reads token t + s + 1, so min(K, n)."""
        if self.method == "mtp" and self.draft_model_config is not None:
            n = num_mtp_layers(self.draft_model_config.hf_text_config)
            return max(1, min(self.num_speculative_tokens, n))
        return 1

    def verify_with_target(self, target: ModelConfig) -> None:
        """Check the draft against the target and point the draft config at the draft
        architecture (the MTP head of the target checkpoint, or the EAGLE head class)."""
        draft = self.draft_model_config
        k = self.num_speculative_tokens
        if self.method == "mtp":
            n = num_mtp_layers(target.hf_text_config)
            if n <= 0:
                raise ValueError(
                    f"speculative_config.method='mtp' needs a target with MTP layers, but "
                    f"{target.model!r} has none (num_nextn_predict_layers is 0 or missing)"
                )
            arch = MTP_DRAFT_ARCHITECTURES.get(target.architecture)
            if arch is None:
                raise ValueError(
                    f"speculative_config.method='mtp' is not supported for {target.architecture}"
                    f"; supported: {sorted(MTP_DRAFT_ARCHITECTURES)}"
                )
            draft.hf_config.architectures = [arch]
            if k > n:
                logger.warning(
                    "num_speculative_tokens=%d exceeds the %d MTP layer(s) of %s: draft step s "
                    "reuses layer s mod %d, so acceptance decays at later positions",
                    k,
                    n,
                    target.model,
                    n,
                )
        else:
            if self.method == "eagle":
                _verify_eagle1_draft(draft, target)
            if draft.architecture in ("LlamaForCausalLM", "Qwen2ForCausalLM") and (
                self.method == "eagle3"
            ):
                draft.hf_config.architectures = ["LlamaForCausalLMEagle3"]
            if draft.vocab_size != target.vocab_size:
                raise ValueError(
                    f"speculative_config.model {self.model!r} embeds a vocabulary of "
                    f"{draft.vocab_size} tokens but the target's has {target.vocab_size}"
                )
        if draft.max_model_len < target.max_model_len:
            raise ValueError(
                f"speculative_config.model {draft.model!r} supports {draft.max_model_len} "
                f"positions, fewer than max_model_len={target.max_model_len}; lower max_model_len"
            )


# EAGLE-1 (method "eagle"): draft folder architecture -> the draft class, and the targets whose
# last hidden state (after the final norm) the public EAGLE-1 heads are trained on.
EAGLE1_DRAFT_ARCHITECTURES = {
    "LlamaForCausalLM": "EagleLlamaForCausalLM",
    "EagleLlamaForCausalLM": "EagleLlamaForCausalLM",
}
EAGLE1_TARGET_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def _verify_eagle1_draft(draft: ModelConfig, target: ModelConfig) -> None:
    """Refuse what the EAGLE-1 layout cannot run; point the draft config at its class."""
    arch = EAGLE1_DRAFT_ARCHITECTURES.get(draft.architecture)
    if arch is None:
        raise ValueError(
            f"speculative_config.method='eagle' (EAGLE-1) needs a draft whose config.json names "
            f"architectures {sorted(EAGLE1_DRAFT_ARCHITECTURES)}; {draft.model!r} names "
            f"{draft.architecture!r}"
        )
    if target.architecture not in EAGLE1_TARGET_ARCHITECTURES:
        raise ValueError(
            f"speculative_config.method='eagle' (EAGLE-1) supports targets "
            f"{list(EAGLE1_TARGET_ARCHITECTURES)}, not {target.architecture}"
        )
    dc, tc = draft.hf_text_config, target.hf_text_config
    n = getattr(dc, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(
            f"speculative_config.model {draft.model!r}: num_hidden_layers must be an integer "
            f">= 1, got {n!r}"
        )
    if int(dc.hidden_size) != int(tc.hidden_size):
        raise ValueError(
            f"speculative_config.model {draft.model!r} has hidden_size={dc.hidden_size} but the "
            f"target's is {tc.hidden_size}: an EAGLE-1 fc reads [embedding; target hidden state] "
            "of one size"
        )
    draft.hf_config.architectures = [arch]


@dataclass
class DeviceConfig:
    """Where the model runs."""

    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""

    def __post_init__(self) -> None:
        import torch

        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")


@dataclass
class CompilationConfig:
    """The shapes the model runner's forwards take (the part of vLLM's compilation_config this
    engine uses)."""

    cudagraph_capture_sizes: list[int] | None = None
    """Token counts a step's flattened batch is padded up to: the smallest size at or above the
    step's token count (a larger step runs unpadded). These are the fixed shapes a captured CUDA
    graph or a compiled forward needs; padded rows are masked out of attention, KV writes,
    linear-attention states and sampling. None or [] (the default): no padding. Sizes above
    max_num_batched_tokens are dropped; enforce_eager turns padding off."""

    @classmethod
    def from_dict(cls, d: dict[str, Any] | CompilationConfig | None) -> CompilationConfig:
        if d is None:
            return cls()
        if isinstance(d, CompilationConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"compilation_config must be a dict, got {type(d).__name__}")
        unknown = set(d) - {"cudagraph_capture_sizes"}
        if unknown:
            raise ValueError(
                f"compilation_config has unsupported key(s) {sorted(unknown)}; supported: "
                "['cudagraph_capture_sizes']"
            )
        return cls(**d)

    def __post_init__(self) -> None:
        sizes = self.cudagraph_capture_sizes
        if sizes is None:
            return
        if not isinstance(sizes, (list, tuple)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes
        ):
            raise ValueError(
                "compilation_config.cudagraph_capture_sizes must be a list of positive "
                f"integers, got {sizes!r}"
            )
        self.cudagraph_capture_sizes = sorted(set(sizes))

    def padded_num_tokens(self, num_tokens: int) -> int:
        """The size a step of num_tokens tokens runs at."""
        for size in self.cudagraph_capture_sizes or ():
            if size >= num_tokens:
                return size
        return num_tokens


@dataclass
class VllmConfig:
    """Everything the engine and workers need, picklable."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding; None: off."""
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    enforce_eager: bool = False
    """Run every step at its own size: no padding to compilation_config's sizes."""
    disable_log_stats: bool = True
    """No periodic stats log line (throughput, spec-decode acceptance); the Prometheus metrics
    are kept either way. `vllm serve` logs them unless given --disable-log-stats."""

    def __post_init__(self) -> None:
        mc, sc = self.model_config, self.scheduler_config
        sc.max_model_len = mc.max_model_len
        cc = self.compilation_config
        if cc.cudagraph_capture_sizes:
            kept = [n for n in cc.cudagraph_capture_sizes if n <= sc.max_num_batched_tokens]
            if len(kept) < len(cc.cudagraph_capture_sizes):
                logger.warning(
                    "cudagraph_capture_sizes above max_num_batched_tokens=%d dropped: %s",
                    sc.max_num_batched_tokens,
                    [n for n in cc.cudagraph_capture_sizes if n > sc.max_num_batched_tokens],
                )
            cc.cudagraph_capture_sizes = kept
        self._resolve_prefix_caching()
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < mc.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={sc.max_num_batched_tokens} is smaller than "
                f"max_model_len={mc.max_model_len} with chunked prefill disabled"
            )
        if self.parallel_config.pipeline_parallel_size > 1:
            from vllm.distributed.utils import get_pp_partition

            # Fail here, in the engine, on P > layers or a bad VLLM_PP_LAYER_PARTITION.
            get_pp_partition(mc.num_hidden_layers, self.parallel_config.pipeline_parallel_size)
        spec = self.speculative_config
        if spec is not None and spec.draft_model_config is None:
            draft_path = spec.model or mc.model
            spec.draft_model_config = ModelConfig(
                model=draft_path,
                tokenizer=mc.tokenizer,
                # The draft shares the runner's KV dtype: resolve "auto" from the target.
                dtype=mc.dtype if mc.dtype != "auto" else (_config_dtype(mc.hf_config) or "auto"),
                seed=mc.seed,
                max_model_len=None,
                trust_remote_code=mc.trust_remote_code,
            )
            spec.verify_with_target(mc)

    def _resolve_prefix_caching(self) -> None:
        cc = self.cache_config
        if cc.enable_prefix_caching is False:
            return
        arch = self.model_config.architecture
        if not self.model_config.is_hybrid:
            cc.enable_prefix_caching = True
        elif cc.enable_prefix_caching is None:
            logger.info(
                "Prefix caching is disabled for the hybrid model %s: its linear-attention "
                "states are kept per request, not per KV block",
                arch,
            )
            cc.enable_prefix_caching = False
        else:
            raise ValueError(
                f"enable_prefix_caching=True is not supported for the hybrid model {arch} "
                "(its linear-attention states are kept per request, not per KV block, so a "
                "cached prefix cannot be resumed); leave it unset or pass "
                "enable_prefix_caching=False (--no-enable-prefix-caching)"
            )

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    def padded_num_tokens(self, num_tokens: int) -> int:
        """Rows a step of num_tokens tokens runs at (every stage computes the same)."""
        if self.enforce_eager:
            return num_tokens
        return self.compilation_config.padded_num_tokens(num_tokens)
