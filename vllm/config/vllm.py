# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""VllmConfig: every config of one engine, checked against each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.config.cache import CacheConfig
from vllm.config.compilation import CompilationConfig
from vllm.config.device import DeviceConfig
from vllm.config.lora import LoRAConfig
from vllm.config.model import ModelConfig, _config_dtype
from vllm.config.parallel import ParallelConfig
from vllm.config.scheduler import SchedulerConfig
from vllm.config.speculative import SpeculativeConfig
from vllm.config.structured_outputs import StructuredOutputsConfig
from vllm.logger import init_logger

logger = init_logger(__name__)


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
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )
    lora_config: LoRAConfig | None = None
    """LoRA adapters (enable_lora); None: off."""
    enforce_eager: bool = False
    """Run every step at its own size: no padding to compilation_config's sizes."""
    disable_log_stats: bool = True
    """No periodic stats log line (throughput, spec-decode acceptance); the Prometheus metrics
    are kept either way. `vllm serve` logs them unless given --disable-log-stats."""

    def __post_init__(self) -> None:
        mc, sc = self.model_config, self.scheduler_config
        assert mc.max_model_len is not None  # ModelConfig.__post_init__ resolves it
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
        if self.parallel_config.tensor_parallel_size > 1:
            self._verify_tensor_parallel()
        spec = self.speculative_config
        draft_tp = spec.draft_tensor_parallel_size if spec is not None else None
        tp = self.parallel_config.tensor_parallel_size
        if draft_tp is not None and draft_tp not in (1, tp):
            raise ValueError(
                f"speculative_config.draft_tensor_parallel_size={draft_tp!r} is not supported "
                f"with tensor_parallel_size={tp}: the draft runs tensor-parallel with its "
                f"target (unset or {tp}) or whole on every rank (1)"
            )
        if (
            spec is not None
            and spec.draft_model_config is None
            and spec.method_info.has_draft_model
        ):
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
        if (
            spec is not None
            and tp > 1
            and spec.draft_tensor_parallel_size != 1
            and spec.method_info.has_draft_model  # ngram / suffix: nothing to split
        ):
            assert spec.draft_model_config is not None
            try:
                _check_tp_split(spec.draft_model_config.hf_text_config, tp)
            except ValueError as e:
                raise ValueError(
                    f"speculative draft {spec.draft_model_config.model}: {e}; set "
                    "speculative_config.draft_tensor_parallel_size=1 to run the draft whole "
                    "on every rank"
                ) from e

    def _verify_tensor_parallel(self) -> None:
        """Refuse, here in the engine, a split the model's shapes do not allow (naming the
        field): every rank must hold a whole number of heads, columns and vocabulary rows."""
        _check_tp_split(self.model_config.hf_text_config, self.parallel_config.tensor_parallel_size)

    def _resolve_prefix_caching(self) -> None:
        cc = self.cache_config
        if cc.enable_prefix_caching is False:
            return
        if not self.model_config.is_hybrid:
            cc.enable_prefix_caching = True
            return
        arch = self.model_config.architecture
        if cc.mamba_cache_mode == "none":
            if cc.enable_prefix_caching:
                raise ValueError(
                    f"enable_prefix_caching=True needs linear-attention state checkpoints for "
                    f"the hybrid model {arch}, but mamba_cache_mode is 'none'"
                )
            logger.info(
                "Prefix caching is disabled for the hybrid model %s (mamba_cache_mode none)", arch
            )
            cc.enable_prefix_caching = False
            return
        cc.enable_prefix_caching = True
        if cc.mamba_num_checkpoints is None:
            cc.mamba_num_checkpoints = 2 * self.scheduler_config.max_num_seqs

    def num_state_checkpoints(self) -> int:
        """Linear-attention state checkpoints per stage (hybrid models with prefix caching)."""
        cc = self.cache_config
        if not (self.model_config.is_hybrid and cc.enable_prefix_caching):
            return 0
        return cc.mamba_num_checkpoints or 0

    @property
    def target_embed_on_last_stage(self) -> bool:
        """Whether the target also builds its input embedding on the last pipeline stage: the
        draft runs there, and one that ships no embedding shares the target's (the method's
        registry entry says whether its drafts may)."""
        spec = self.speculative_config
        return (
            spec is not None
            and spec.method_info.draft_shares_target_embed
            and self.parallel_config.pipeline_parallel_size > 1
        )

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    def padded_num_tokens(self, num_tokens: int) -> int:
        """Rows a step of num_tokens tokens runs at (every stage computes the same)."""
        if self.enforce_eager:
            return num_tokens
        return self.compilation_config.padded_num_tokens(num_tokens)


def _check_tp_split(cfg: Any, tp: int) -> None:
    """Raise ValueError naming the first of the model config's sizes that TP ranks cannot
    split: every rank must hold a whole number of heads, columns and vocabulary rows."""
    for name in _TP_SPLIT_FIELDS:
        n = getattr(cfg, name, None)
        if isinstance(n, int) and n % tp:
            raise ValueError(
                f"the model's {name} ({n}) is not divisible by tensor_parallel_size ({tp})"
            )
    kv = getattr(cfg, "num_key_value_heads", None)
    if isinstance(kv, int) and kv % tp and tp % kv:
        raise ValueError(
            f"the model's num_key_value_heads ({kv}) and tensor_parallel_size ({tp}) do not "
            "divide each other (each rank needs whole KV heads, or one shared by TP / "
            "num_key_value_heads ranks)"
        )


# Sizes split over the TP ranks (heads, MLP / expert columns, vocabulary rows).
_TP_SPLIT_FIELDS = (
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "index_n_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
