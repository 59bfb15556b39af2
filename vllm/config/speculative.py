# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""SpeculativeConfig: the drafter (MTP, EAGLE, EAGLE3, DFlash, DSpark, n-gram prompt lookup),
its checks against the target, and how many drafts a step verifies (the batch-size schedule and
the adaptive per-request K)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vllm.config.draft import get_eagle3_use_aux_hidden_state_from_config, verify_dflash_draft
from vllm.config.model import ModelConfig
from vllm.config.spec_methods import (
    _METHOD_ALIASES,
    EAGLE1_DRAFT_ARCHITECTURES,
    EAGLE1_TARGET_ARCHITECTURES,
    SPEC_METHODS,
    SpecMethod,
    num_mtp_layers,
    verify_mtp_target,
)
from vllm.config.spec_tree import check_tree, check_tree_target, fill_tree_k
from vllm.logger import init_logger

logger = init_logger(__name__)


_TREE_KEYS = ("speculative_token_tree", "tree_top_k", "num_tree_nodes", "tree_max_depth")
_SPEC_KEYS = {
    "method",
    "num_speculative_tokens",
    "model",
    "draft_sample_method",
    "max_model_len",
    "draft_tensor_parallel_size",
    "quantization",
    "revision",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "num_speculative_tokens_per_batch_size",
    "adaptive_num_speculative_tokens",
    "adaptive_draft_confidence",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
    "grammar_aware_drafting",
    "hybrid_method",
    "hybrid_min_match_length",
    "hybrid_model_num_speculative_tokens",
    *_TREE_KEYS,
}
_HYBRID_KEYS = ("hybrid_method", "hybrid_min_match_length", "hybrid_model_num_speculative_tokens")
_SUFFIX_KEYS = (
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
)


def _with_speculators_defaults(d: dict[str, Any]) -> dict[str, Any]:
    """A speculators-format draft (`model` with speculators_model_type) names its method and
    the K it was trained for: fill in whichever of the two the user left out, and refuse a
    method that contradicts the checkpoint."""
    model = d.get("model")
    if not isinstance(model, str | os.PathLike):
        return d
    from vllm.transformers_utils.speculators import (
        read_speculators_config,
        speculators_method,
        speculators_num_speculative_tokens,
    )

    raw = read_speculators_config(model)
    if raw is None:
        return d
    where = f"speculative_config.model {str(model)!r}"
    method = speculators_method(raw, where)
    d = dict(d)
    given = d.get("method")
    if given is None:
        d["method"] = method
    elif _METHOD_ALIASES.get(given, given) != method:
        raise ValueError(
            f"speculative_config.method {given!r} does not match {where}, a speculators "
            f"{raw.get('speculators_model_type')!r} checkpoint (method {method!r})"
        )
    if d.get("num_speculative_tokens") is None:
        k = speculators_num_speculative_tokens(raw)
        if k is not None:
            d["num_speculative_tokens"] = k
    return d


@dataclass
class SpeculativeConfig:
    """Speculative decoding: which drafter and how many tokens it proposes per step."""

    method: str = "mtp"
    """mtp | eagle | eagle3 | dflash | dspark (deepseek_mtp, qwen3_5_mtp ... map to mtp)."""
    num_speculative_tokens: int = 1
    """K: draft tokens proposed per step."""
    model: str | None = None
    """Draft checkpoint folder; for mtp defaults to the target checkpoint."""
    draft_sample_method: str = "greedy"
    """greedy | probabilistic: how the draft picks its tokens."""
    draft_tensor_parallel_size: int | None = None
    """The draft's TP: None or the target's tensor_parallel_size (the draft's layers split
    like the target's), or 1 (the draft whole on every TP rank of the last stage, each
    computing the same; TP rank 0's tokens are used)."""
    prompt_lookup_min: int | None = None
    """ngram: the shortest n-gram matched (default: prompt_lookup_max, or 5 when neither is
    given, as vLLM)."""
    prompt_lookup_max: int | None = None
    """ngram: the longest n-gram matched, tried first (default: prompt_lookup_min, or 5)."""
    num_speculative_tokens_per_batch_size: list[list[int]] | None = None
    """[[start_bs, end_bs, K], ...]: the drafts a step verifies per request when the batch has
    start_bs..end_bs requests (inclusive; K = 0: none); batch sizes not listed use
    num_speculative_tokens."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: the longest match plus draft (the suffix trees' depth); K defaults to it."""
    suffix_decoding_max_cached_requests: int = 10000
    """suffix: earlier requests whose outputs are searched (FIFO); 0 turns the global cache
    off (only the request's own tokens are searched)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: at most this many drafts per matched token (draft length <= factor x match)."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: drafting stops before a token whose estimated probability (the product of the
    frequencies along the draft) falls below this."""
    hybrid_method: str | None = None
    """A draft-free proposer ("suffix" or "ngram") run beside the draft model of `method`
    (mtp, eagle, eagle3): per request and step, its drafts are used when its match is at
    least hybrid_min_match_length tokens, the draft model's otherwise. None: off."""
    hybrid_min_match_length: int = 4
    """hybrid: the shortest match whose draft-free proposal wins over the draft model's."""
    hybrid_model_num_speculative_tokens: int | None = None
    """hybrid: the draft model's own K (default: num_speculative_tokens); num_speculative_tokens
    is then the most any proposal drafts (a long suffix match can draft more than the model)."""
    grammar_aware_drafting: bool = True
    """Structured-output requests: a draft model's choices are masked by the request's
    grammar, drafts the grammar forbids are never proposed, and where the grammar forces the
    next tokens (jump-forward) those are the drafts (verified like any other)."""
    adaptive_num_speculative_tokens: bool = True
    """Choose each request's K every step from its measured acceptance per position and the
    step cost measured at start-up, down to 0 when drafting does not pay (probed again
    later); never above the batch-size schedule. Output does not depend on it."""
    adaptive_draft_confidence: bool = True
    """Adaptive EAGLE / EAGLE3 chains and dynamic trees: shape each step by the draft's own
    confidence in its drafts, calibrated online (core/sched/draft_confidence.py). Output does
    not depend on it."""
    speculative_token_tree: str | None = None
    """A static draft tree: vLLM's list of paths of child ranks (config/spec_tree.py)."""
    tree_top_k: int | None = None
    tree_max_depth: int | None = None
    num_tree_nodes: int | None = None
    """A dynamic tree (EAGLE-2): nodes per step (= K), expanding tree_top_k (default 4)
    children per depth, at most tree_max_depth (default 5) deep; None: none (spec_tree.py)."""
    draft_model_config: Any = field(default=None, repr=False)
    """The draft's ModelConfig (filled by VllmConfig; None for ngram)."""

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
        if d.get("model") in ("ngram", "[ngram]"):
            # vLLM's older spelling of prompt lookup: model="[ngram]" (no draft folder).
            if d.get("method") not in (None, "ngram", "[ngram]"):
                raise ValueError(
                    f"speculative_config.model {d['model']!r} means method 'ngram', not "
                    f"{d['method']!r}"
                )
            d = {**{k: v for k, v in d.items() if k != "model"}, "method": "ngram"}
        d = _with_speculators_defaults(fill_tree_k(d))
        if d.get("method") == "suffix" and d.get("num_speculative_tokens") is None:
            # K is the most a match can draft: the tree depth (vLLM's default for suffix).
            d = {**d, "num_speculative_tokens": d.get("suffix_decoding_max_tree_depth", 24)}
        if d.get("method") is None:
            raise ValueError("speculative_config.method is required (e.g. 'mtp' or 'eagle3')")
        names = (
            "method",
            "num_speculative_tokens",
            "model",
            "draft_sample_method",
            "draft_tensor_parallel_size",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "num_speculative_tokens_per_batch_size",
            "adaptive_num_speculative_tokens",
            "adaptive_draft_confidence",
            *_SUFFIX_KEYS,
            "grammar_aware_drafting",
            *_HYBRID_KEYS,
            *_TREE_KEYS,
        )
        keep: dict[str, Any] = {k: d[k] for k in names if d.get(k) is not None}
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
        if self.method_info.needs_draft_model and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r}")
        self._check_prompt_lookup()
        self._check_suffix()
        self._check_batch_size_schedule()
        self._check_hybrid()
        check_tree(self)
        if not isinstance(self.grammar_aware_drafting, bool):
            raise ValueError(
                "speculative_config.grammar_aware_drafting must be true or false, got "
                f"{self.grammar_aware_drafting!r}"
            )
        if self.method == "jump_forward" and not self.grammar_aware_drafting:
            raise ValueError(
                "speculative_config.method 'jump_forward' drafts through the grammar: "
                "grammar_aware_drafting must stay true"
            )
        if not isinstance(self.adaptive_draft_confidence, bool):
            raise ValueError(
                "speculative_config.adaptive_draft_confidence must be true or false, got "
                f"{self.adaptive_draft_confidence!r}"
            )
        if not isinstance(self.adaptive_num_speculative_tokens, bool):
            raise ValueError(
                "speculative_config.adaptive_num_speculative_tokens must be true or false, got "
                f"{self.adaptive_num_speculative_tokens!r}"
            )

    def _check_prompt_lookup(self) -> None:
        """vLLM's defaults and checks for prompt_lookup_min / prompt_lookup_max."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
        if self.method != "ngram" and self.hybrid_method != "ngram":
            if lo is not None or hi is not None:
                logger.warning(
                    "speculative_config.prompt_lookup_min/max are ignored by method %r",
                    self.method,
                )
            return
        if self.method == "ngram" and self.model:
            raise ValueError(
                f"speculative_config.model must not be set for method 'ngram' (it drafts from "
                f"the request's own tokens), got {self.model!r}"
            )
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        assert lo is not None and hi is not None
        if lo > hi:
            raise ValueError(
                f"speculative_config.prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}"
            )
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    def _check_hybrid(self) -> None:
        where = "speculative_config."
        h = self.hybrid_method
        if h is None:
            if self.hybrid_model_num_speculative_tokens is not None:
                raise ValueError(f"{where}hybrid_model_num_speculative_tokens needs hybrid_method")
            return
        if h not in ("suffix", "ngram"):
            raise ValueError(f"{where}hybrid_method must be 'suffix' or 'ngram', got {h!r}")
        if self.method not in ("mtp", "eagle", "eagle3"):
            raise ValueError(
                f"{where}hybrid_method combines a draft-free proposer with a draft model that "
                f"drafts token by token (mtp, eagle, eagle3), not method {self.method!r}"
            )
        m = self.hybrid_min_match_length
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"{where}hybrid_min_match_length must be an integer >= 1, got {m!r}")
        k = self.hybrid_model_num_speculative_tokens
        if k is None:
            self.hybrid_model_num_speculative_tokens = self.num_speculative_tokens
        elif (
            not isinstance(k, int)
            or isinstance(k, bool)
            or not 1 <= k <= self.num_speculative_tokens
        ):
            raise ValueError(
                f"{where}hybrid_model_num_speculative_tokens must be an integer in 1.."
                f"{self.num_speculative_tokens} (num_speculative_tokens), got {k!r}"
            )

    def _check_suffix(self) -> None:
        where = "speculative_config."
        depth = self.suffix_decoding_max_tree_depth
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 2:
            raise ValueError(
                f"{where}suffix_decoding_max_tree_depth must be an integer >= 2, got {depth!r}"
            )
        cached = self.suffix_decoding_max_cached_requests
        if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
            raise ValueError(
                f"{where}suffix_decoding_max_cached_requests must be an integer >= 0, got "
                f"{cached!r}"
            )
        factor = self.suffix_decoding_max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
            raise ValueError(
                f"{where}suffix_decoding_max_spec_factor must be a number > 0, got {factor!r}"
            )
        prob = self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, int | float) or not 0 <= prob <= 1:
            raise ValueError(
                f"{where}suffix_decoding_min_token_prob must be a number in [0, 1], got {prob!r}"
            )
        if self.method in ("suffix", "jump_forward") and self.model:
            raise ValueError(
                f"speculative_config.model must not be set for method {self.method!r} (it "
                f"drafts without a draft model), got {self.model!r}"
            )

    def _check_batch_size_schedule(self) -> None:
        sched = self.num_speculative_tokens_per_batch_size
        if sched is None:
            return
        where = "speculative_config.num_speculative_tokens_per_batch_size"
        if not isinstance(sched, list | tuple) or not sched:
            raise ValueError(f"{where} must be a non-empty list of [start_bs, end_bs, K]")
        rows: list[list[int]] = []
        for e in sched:
            if (
                not isinstance(e, list | tuple)
                or len(e) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in e)
            ):
                raise ValueError(f"{where}: each entry must be [start_bs, end_bs, K], got {e!r}")
            lo, hi, k = e
            if lo < 1 or hi < lo:
                raise ValueError(f"{where}: entry {list(e)} needs 1 <= start_bs <= end_bs")
            if not 0 <= k <= self.num_speculative_tokens:
                raise ValueError(
                    f"{where}: entry {list(e)} has K={k}; it must be in 0.."
                    f"{self.num_speculative_tokens} (num_speculative_tokens)"
                )
            rows.append([lo, hi, k])
        rows.sort()
        for a, b in zip(rows, rows[1:]):
            if b[0] <= a[1]:
                raise ValueError(f"{where}: entries {a} and {b} overlap")
        self.num_speculative_tokens_per_batch_size = rows

    def k_for_batch_size(self, batch_size: int) -> int:
        """The most drafts per request the schedule allows at this batch size."""
        for lo, hi, k in self.num_speculative_tokens_per_batch_size or ():
            if lo <= batch_size <= hi:
                return k
        return self.num_speculative_tokens

    @property
    def method_info(self) -> SpecMethod:
        return SPEC_METHODS[self.method]

    @property
    def uses_aux_hidden_states(self) -> bool:
        """Whether the draft reads the target's aux hidden states (EAGLE3 taps)."""
        need = self.method_info.aux_hidden_states
        if need == "config":
            cfg = self.draft_model_config.hf_text_config
            return get_eagle3_use_aux_hidden_state_from_config(cfg)
        return need == "always"

    @property
    def is_tree(self) -> bool:
        return bool(self.speculative_token_tree) or self.num_tree_nodes is not None

    @property
    def num_lookahead_tokens(self) -> int:
        """How many tokens after a position the draft's KV at that position depends on: 1 for
        a draft that reads the next token there (EAGLE, one MTP layer, an MTP tree); with n
        chained MTP layers, layer s at position t reads token t + s + 1, so min(K, n)."""
        if not self.method_info.has_draft_model:
            return 0  # no draft KV
        if self.method_info.family == "mtp" and self.draft_model_config is not None:
            if self.is_tree:  # every depth drafted by the first MTP layer
                return 1
            n = num_mtp_layers(self.draft_model_config.hf_text_config)
            return max(1, min(self.num_speculative_tokens, n))
        return 1

    def verify_with_target(self, target: ModelConfig) -> None:
        """Check the draft against the target and point the draft config at the draft
        architecture (the MTP head of the target checkpoint, or the EAGLE head class)."""
        draft = self.draft_model_config
        k = self.num_speculative_tokens
        check_tree_target(self, target)
        if self.method_info.family == "mtp":
            verify_mtp_target(draft, target, k, self.is_tree)
        else:
            family = self.method_info.family
            if family == "eagle":
                _verify_eagle1_draft(draft, target)
            if family == "eagle3" and draft.architecture in (
                "LlamaForCausalLM",
                "Qwen2ForCausalLM",
            ):
                draft.hf_config.architectures = ["LlamaForCausalLMEagle3"]
            if family == "dflash":
                verify_dflash_draft(draft.hf_text_config, self.method, k, target, draft.model)
            _check_speculators_head(draft, target)
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


def _check_speculators_head(draft: ModelConfig, target: ModelConfig) -> None:
    """A speculators head names the hidden size and architecture of the verifier it was
    trained against: a different hidden size cannot work, a different architecture may."""
    cfg = draft.hf_text_config
    if getattr(cfg, "speculators_model_type", None) is None:
        return
    want = getattr(cfg, "target_hidden_size", None) or cfg.hidden_size
    have = int(target.hf_text_config.hidden_size)
    if int(want) != have:
        raise ValueError(
            f"speculative_config.model {draft.model!r} was trained on a verifier with hidden "
            f"size {want}, but the target's is {have}"
        )
    archs = (getattr(cfg, "speculators_verifier", None) or {}).get("architectures") or []
    if archs and target.architecture not in archs:
        logger.warning(
            "speculative_config.model %s was trained against %s, the target is %s",
            draft.model,
            archs,
            target.architecture,
        )


# EAGLE-1 (method "eagle"): draft folder architecture -> the draft class, and the targets whose
# last hidden state (after the final norm) the public EAGLE-1 heads are trained on.
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
