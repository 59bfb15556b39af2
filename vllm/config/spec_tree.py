# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Draft trees: parsing and checking speculative_config.speculative_token_tree (vLLM's static
tree format) and the dynamic-tree keys.

A static tree is a list of paths, each a tuple of child ranks: (0,) is the draft's most likely
token after the last accepted one, (1,) its second most likely, (0, 2) the third most likely
token after (0,), and so on. Every path's prefixes must be listed too. The nodes are kept in
(depth, path) order - breadth first, so a node's parent always comes before it and any prefix
of the list is itself a tree (what a step verifying fewer drafts uses) - and the number of nodes
is num_speculative_tokens.

A dynamic tree (EAGLE-2) is grown per step from the draft's probabilities: num_tree_nodes nodes
(= num_speculative_tokens), at most tree_max_depth deep, each depth expanding the tree_top_k
children of the tree_top_k best nodes of the depth before (best: the product of the draft's
probabilities along the path), then the num_tree_nodes best of all candidates are kept, most
probable first (ties: the shallower first). A child is never more probable than its parent, so
a parent still comes before its children and any prefix of k nodes is the k most probable
connected subtree - what a request verifying only k of them (the adaptive K) checks.
"""

from __future__ import annotations

import ast
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

WHERE = "speculative_config.speculative_token_tree"
# Methods whose draft model proposes token by token from the target's hidden states.
TREE_METHODS = ("eagle", "eagle3", "mtp")
DEFAULT_TREE_TOP_K = 4
DEFAULT_TREE_MAX_DEPTH = 5


def parse_token_tree(value: Any) -> list[tuple[int, ...]]:
    """The tree's paths in (depth, path) order, or ValueError naming the field."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"{WHERE} must be a list of tuples of ints, got {value!r}") from e
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"{WHERE} must be a non-empty list of paths, got {value!r}")
    paths: list[tuple[int, ...]] = []
    for p in value:
        if (
            not isinstance(p, list | tuple)
            or not p
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in p)
        ):
            raise ValueError(
                f"{WHERE}: each path must be a non-empty tuple of child ranks >= 0, got {p!r}"
            )
        paths.append(tuple(p))
    seen = set(paths)
    if len(seen) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise ValueError(f"{WHERE} lists the path {dup} twice")
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"{WHERE}: path {p} is listed without its parent {p[:-1]}")
    return sorted(paths, key=lambda p: (len(p), p))


def tree_parents(paths: list[tuple[int, ...]]) -> list[int]:
    """Each node's parent index in the sorted paths (-1: the root, the last accepted token)."""
    index = {p: i for i, p in enumerate(paths)}
    return [index[p[:-1]] if len(p) > 1 else -1 for p in paths]


def check_tree(spec: Any) -> None:
    """Validate the tree keys of a SpeculativeConfig (after from_dict filled K)."""
    tree, top_k, nodes = spec.speculative_token_tree, spec.tree_top_k, spec.num_tree_nodes
    if tree is None and top_k is None and nodes is None and spec.tree_max_depth is None:
        return
    for name in ("tree_top_k", "num_tree_nodes", "tree_max_depth"):
        v = getattr(spec, name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
    if spec.method not in TREE_METHODS:
        raise ValueError(
            f"speculative_config: draft trees (speculative_token_tree / num_tree_nodes) need "
            f"a method in {list(TREE_METHODS)}, not {spec.method!r}"
        )
    if spec.hybrid_method is not None:
        raise ValueError("speculative_config: a draft tree cannot be combined with hybrid_method")
    k = spec.num_speculative_tokens
    if tree is not None:
        if nodes is not None or top_k is not None or spec.tree_max_depth is not None:
            raise ValueError(
                f"{WHERE} (a static tree) cannot be combined with tree_top_k / num_tree_nodes / "
                "tree_max_depth (a dynamic tree)"
            )
        paths = parse_token_tree(tree)
        if k != len(paths):
            raise ValueError(
                f"{WHERE} has {len(paths)} nodes but num_speculative_tokens is {k}; leave "
                "num_speculative_tokens out (it is the number of nodes)"
            )
        spec.speculative_token_tree = str(paths)
        return
    if nodes is None:
        raise ValueError("speculative_config.tree_top_k / tree_max_depth need num_tree_nodes")
    if k != nodes:
        raise ValueError(
            f"speculative_config.num_tree_nodes={nodes} must equal num_speculative_tokens={k} "
            "(leave num_speculative_tokens out)"
        )
    spec.tree_top_k = top_k or DEFAULT_TREE_TOP_K
    spec.tree_max_depth = min(spec.tree_max_depth or DEFAULT_TREE_MAX_DEPTH, nodes)


def fill_tree_k(d: dict[str, Any]) -> dict[str, Any]:
    """from_dict: K defaults to the number of tree nodes."""
    if d.get("num_speculative_tokens") is not None:
        return d
    if d.get("speculative_token_tree") is not None:
        return {**d, "num_speculative_tokens": len(parse_token_tree(d["speculative_token_tree"]))}
    if d.get("num_tree_nodes") is not None:
        return {**d, "num_speculative_tokens": d["num_tree_nodes"]}
    return d


def check_tree_target(spec: Any, target: Any) -> None:
    """Refuse a tree the target cannot verify (a linear-attention state cannot branch); say
    that an MTP tree drafts with the first of several MTP layers."""
    if not (spec.speculative_token_tree or spec.num_tree_nodes):
        return
    if target.is_hybrid:
        raise ValueError(
            f"{WHERE} / num_tree_nodes: draft trees are not supported for the hybrid model "
            f"{target.architecture} (its linear-attention layers keep one recurrent state per "
            "request, which cannot branch); use a chain (num_speculative_tokens)"
        )
    if spec.method == "mtp":
        from vllm.config.spec_methods import num_mtp_layers

        n = num_mtp_layers(target.hf_text_config)
        if n > 1:
            logger.warning(
                "a draft tree drafts every depth with the first of the %d MTP layers of %s "
                "(a chained layer needs one row per position; a tree has several)",
                n,
                target.model,
            )
