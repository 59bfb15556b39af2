# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Draft trees, piece by piece: speculative_token_tree parsing and refusals (naming the field),
the tree walk that accepts the longest path the target agrees with (every branch wrong, the
deepest branch right, a fork at the root), KV compaction into chain order, and the tree mask
of the CPU attention backends against a dense reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.attention.backends.torch_paged import TorchPagedAttentionImpl, build_attn_metadata
from vllm.config import SpeculativeConfig
from vllm.config.spec_tree import parse_token_tree
from vllm.v1.worker.gpu.input_batch import prepare_inputs
from vllm.v1.worker.gpu.spec_decode.tree import (
    StaticTree,
    accept,
    ancestor_mask,
    apply_layout,
    compact_kv,
    path_from_result,
    path_slots,
)
from vllm.v1.worker.gpu.states import RequestStates

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


# ---- config ---------------------------------------------------------------------------------


def _spec(**kw) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "eagle3", "model": "/nonexistent", **kw})


def test_tree_sorted_and_sets_k():
    s = _spec(speculative_token_tree="[(1,), (0, 0), (0,)]")
    assert s.num_speculative_tokens == 3
    assert parse_token_tree(s.speculative_token_tree) == [(0,), (1,), (0, 0)]
    assert StaticTree(parse_token_tree(s.speculative_token_tree)).parents.tolist() == [-1, -1, 0]


@pytest.mark.parametrize(
    "tree, match",
    [
        ("[(0,), (0,)]", "twice"),
        ("[]", "non-empty"),
        ("[(0,), ()]", "non-empty tuple"),
        ("[(0,), (-1,)]", "child ranks"),
        ("[(0,), (1.5,)]", "child ranks"),
        ("not a tree", "list of tuples"),
        ("[(0, 0)]", "without its parent"),
        ("[(0,), (1, 0), (1, 0, 0)]", "without its parent"),
    ],
)
def test_bad_trees_refused_naming_the_field(tree, match):
    with pytest.raises(ValueError, match="speculative_token_tree") as e:
        _spec(speculative_token_tree=tree)
    assert match in str(e.value)


def test_tree_refusals():
    with pytest.raises(ValueError, match="speculative_token_tree has 2 nodes"):
        _spec(speculative_token_tree="[(0,), (1,)]", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="draft trees .* need a method"):
        SpeculativeConfig.from_dict({"method": "ngram", "speculative_token_tree": "[(0,)]"})
    with pytest.raises(ValueError, match="tree_top_k"):
        _spec(speculative_token_tree="[(0,)]", tree_top_k=2)


# ---- acceptance ------------------------------------------------------------------------------


def _batch(drafts: list[list[int]], ctx: list[int], tree=TREE):
    """A verify step: request r has ctx[r] computed tokens and the drafts drafts[r]."""
    R = len(drafts)
    K = len(tree)
    st = RequestStates(R, 128, 16, K)
    for r, d in enumerate(drafts):
        st.req_id_to_slot[f"r{r}"] = r
        st.token_ids[r, : ctx[r] + 1] = np.arange(ctx[r] + 1) + 1000
        st.num_tokens[r] = ctx[r] + 1
        st.num_computed[r] = ctx[r]
        st.block_table[r, :4] = np.arange(4) + 4 * r
        st.draft_tokens[r, : len(d)] = d
    n = np.array([len(d) + 1 for d in drafts])
    b = prepare_inputs(st, [f"r{r}" for r in range(R)], n, 16, torch.device("cpu"), K + 1)
    t = StaticTree(tree)
    apply_layout(b, lambda r, k: t.parents[:k])
    return b, t


def _accept(b, t, target_rows):
    tokens = np.concatenate(target_rows)
    return accept(b, tokens, lambda r, k: t.parents[:k], len(t.paths) + 1)


def test_every_branch_wrong():
    b, t = _batch([[10, 11, 12, 13, 14, 15, 16]], [5])
    sampled, n, tp = _accept(b, t, [np.array([99, 1, 2, 3, 4, 5, 6, 7])])
    assert n.tolist() == [1] and sampled[0, 0] == 99 and tp.paths == [[]]


def test_deepest_branch_right():
    # Root's target token 10 = node 0; node 0's 13 = node 3; node 3's 16 = node 6; bonus 77.
    b, t = _batch([[10, 11, 12, 13, 14, 15, 16]], [5])
    y = np.array([10, 13, 0, 0, 16, 0, 0, 77])
    sampled, n, tp = _accept(b, t, [y])
    assert n.tolist() == [4] and sampled[0, :4].tolist() == [10, 13, 16, 77]
    assert tp.paths == [[0, 3, 6]]


def test_fork_at_the_root():
    # The target picks the root's third child (node 2, no children): that token and its bonus.
    b, t = _batch([[10, 11, 12, 13, 14, 15, 16], [20, 21]], [5, 30])
    y0 = np.array([12, 0, 0, 55, 0, 0, 0, 0])
    y1 = np.array([21, 0, 66])  # request 1 verifies only its first 2 nodes (both at depth 1)
    sampled, n, tp = _accept(b, t, [y0, y1])
    assert n.tolist() == [2, 2]
    assert sampled[0, :2].tolist() == [12, 55] and sampled[1, :2].tolist() == [21, 66]
    assert tp.paths == [[2], [1]]
    # The stages without logits re-derive the same path from the drafts and the tokens.
    drafts = np.array([10, 11, 12, 13, 14, 15, 16])
    assert path_from_result(drafts, t.parents, sampled[0, :2]) == [2]


def test_layout_positions_and_mask():
    b, t = _batch([[10, 11, 12, 13, 14, 15, 16]], [5])
    assert b.positions_np.tolist() == [5, 6, 6, 6, 7, 7, 7, 8]
    assert b.positions.tolist()[:8] == [5, 6, 6, 6, 7, 7, 7, 8]
    m = b.attn_metadata.tree_mask[0].numpy()
    assert (m == ancestor_mask(t.parents)).all()
    assert m[7].nonzero()[0].tolist() == [0, 1, 4, 7]  # (0, 0, 0): root, (0,), (0, 0), itself


def test_compaction_moves_the_accepted_path():
    b, t = _batch([[10, 11, 12, 13, 14, 15, 16]], [5])
    cache = torch.arange(2 * 64 * 3, dtype=torch.float32).view(2, 64, 3)
    before = cache.clone()
    src, dst = path_slots(b.block_table_np[0], 16, 5, [0, 3, 6])
    assert src.tolist() == [6, 9, 12] and dst.tolist() == [6, 7, 8]
    compact_kv({"l": cache}, 64, src, dst)
    assert torch.equal(cache[:, [6, 7, 8]], before[:, [6, 9, 12]])
    keep = [i for i in range(64) if i not in (7, 8)]
    assert torch.equal(cache[:, keep], before[:, keep])


# ---- the tree mask in the CPU backend ------------------------------------------------------


def _dense_reference(q, k_cache, v_cache, slots_of, allowed, scale):
    """Per query row: softmax over exactly the (slot) keys it may see."""
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    for t in range(q.shape[0]):
        ks = k_cache[slots_of[t]]  # [n, Hkv, D]
        vs = v_cache[slots_of[t]]
        rep = q.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        s = torch.einsum("hd,nhd->hn", q[t], ks) * scale
        out[t] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vs)
        assert allowed[t] == len(slots_of[t])
    return out


@pytest.mark.parametrize(
    "decode_too, path",
    [(False, "kernel"), (True, "kernel"), (True, "long"), (False, "sdpa"), (True, "sdpa")],
)
def test_tree_mask_matches_dense_reference(decode_too, path, monkeypatch):
    """kernel: the tree rows run in the C++ decode kernel with the mask; long: the tree request
    is a long query (the padded SDPA group with the mask), the decode row in the kernel; sdpa:
    no kernels (the padded torch path)."""
    from vllm import _custom_ops as ops
    from vllm.attention.backends import torch_paged

    kernel_masks: list = []
    if path == "sdpa":
        monkeypatch.setattr(torch_paged, "use_cpu_kernel", lambda *a: False)
    else:
        if not ops.cpu_kernels_available():
            pytest.skip("CPU kernels not built")
        real = ops.paged_attention

        def spy(*args, **kwargs):
            kernel_masks.append(kwargs.get("tree_mask"))
            return real(*args, **kwargs)

        monkeypatch.setattr(ops, "paged_attention", spy)
    short_query_len = 4 if path == "long" else 8
    torch.manual_seed(0)
    H, Hkv, D, bs = 4, 2, 8, 4
    parents = np.array([-1, -1, 0, 0, 1, 2])
    ctx = [9] + ([5] if decode_too else [])
    q_lens = [len(parents) + 1] + ([1] if decode_too else [])
    R = len(ctx)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    seq = np.array(ctx) + np.array(q_lens)
    table = np.array([[3, 1, 6, 0], [2, 5, 4, 7]])[:R]
    T = int(qsl[-1])
    meta = build_attn_metadata(
        qsl, seq, table, bs, torch.device("cpu"), short_query_len=short_query_len
    )
    M = max(q_lens)
    mask = np.tril(np.ones((R, M, M), dtype=bool))
    mask[0, : len(parents) + 1, : len(parents) + 1] = ancestor_mask(parents)
    meta.tree_mask = torch.from_numpy(mask)
    impl = TorchPagedAttentionImpl(H, D, Hkv, 0.3)
    cache = torch.randn(2, 8 * bs, Hkv, D)
    q, k, v = torch.randn(T, H * D), torch.randn(T, Hkv * D), torch.randn(T, Hkv * D)
    out = impl.forward(q, k, v, cache, meta).view(T, H, D)

    def slot(r, p):
        return int(table[r, p // bs] * bs + p % bs)

    slots_of, allowed = [], []
    for r in range(R):
        for i in range(q_lens[r]):
            seen = [slot(r, p) for p in range(ctx[r])]
            seen += [slot(r, ctx[r] + j) for j in range(q_lens[r]) if mask[r, i, j]]
            slots_of.append(seen)
            allowed.append(len(seen))
    ref = _dense_reference(q.view(T, H, D), cache[0], cache[1], slots_of, allowed, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if path != "sdpa":  # the kernel ran, with the mask
        assert kernel_masks and all(m is not None for m in kernel_masks)
    # Without the mask the tree rows see their siblings: the result must differ.
    meta2 = build_attn_metadata(qsl, seq, table, bs, torch.device("cpu"), short_query_len=8)
    causal = impl.forward(q, k, v, cache, meta2).view(T, H, D)
    assert not torch.allclose(causal[2:7], ref[2:7], atol=1e-3)


def test_tree_refused_for_hybrid_model(tmp_path):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.testing.qwen3_5_checkpoints import make_qwen3_5

    model = make_qwen3_5(tmp_path / "q35")
    spec = {"method": "eagle3", "model": str(model), "speculative_token_tree": "[(0,), (1,)]"}
    args = EngineArgs(model=str(model), max_model_len=128, speculative_config=spec)
    with pytest.raises(ValueError, match="speculative_token_tree.*hybrid model"):
        args.create_engine_config()


def test_mtp_tree_accepted_for_dsa_and_multi_layer_mtp(tmp_path, deepseek_v3_mtp2_dir):
    """DeepSeek-V3.2's sparse attention and a target with two MTP layers take a tree (the
    latter drafts every depth with its first layer, one lookahead token): end to end in
    tests/e2e/test_dsa_tree.py and tests/e2e/test_bundled_model.py."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.testing.dsa_checkpoints import make_deepseek_v32

    dsa = make_deepseek_v32(tmp_path / "v32", num_nextn_predict_layers=1)
    for model in (dsa, deepseek_v3_mtp2_dir):
        for tree in ({"speculative_token_tree": "[(0,), (1,)]"}, {"num_tree_nodes": 3}):
            spec = {"method": "mtp", **tree}
            args = EngineArgs(model=str(model), max_model_len=128, speculative_config=spec)
            cfg = args.create_engine_config().speculative_config
            assert cfg.is_tree and cfg.num_lookahead_tokens == 1
    chain = {"method": "mtp", "num_speculative_tokens": 2}
    args = EngineArgs(model=deepseek_v3_mtp2_dir, max_model_len=128, speculative_config=chain)
    assert args.create_engine_config().speculative_config.num_lookahead_tokens == 2
