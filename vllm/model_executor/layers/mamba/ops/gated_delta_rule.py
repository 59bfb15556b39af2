# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Gated delta rule (Gated DeltaNet's recurrence) in torch: a per-token recurrent form and a
chunked form for prefill; both start from and return the recurrent state.

Per value head, with state S [dk, dv], decay g_t (log space), step size beta_t:
    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t
q and k arrive already normalised and scaled. All arithmetic is float32. The varlen form runs
a flattened token batch over per-request state slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.attention.backends.gdn_attn import GDNAttentionMetadata


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    keep_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, L, H, dk]; v [B, L, H, dv]; g, beta [B, L, H]; state [B, H, dk, dv] (float32).

    Returns (o [B, L, H, dv] float32, the final state [B, H, dk, dv]) or, with keep_states,
    the state after every step [B, L, H, dk, dv] instead of the final one.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    s = state.float().clone()
    length = q.shape[1]
    out = v.new_empty(v.shape)
    kept = []
    for t in range(length):
        s = s * g[:, t].exp()[..., None, None]
        k_t = k[:, t]
        pred = torch.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v[:, t] - pred) * beta[:, t, :, None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, t])
        if keep_states:
            kept.append(s)
    if keep_states:
        return out, torch.stack(kept, dim=1) if kept else state.float()[:, None]
    return out, s


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
    keep_at: Sequence[int] = (),
    kept: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as recurrent_gated_delta_rule (final state only), computed chunk by chunk.
    keep_at: step counts (1..L) after which the state is also appended to `kept` (chunks are
    cut there; the prefix-cache checkpoints of a long query).

    Within a chunk, with G_t the cumulative decay since the chunk start and S0 the entering
    state, the corrections d_t = beta_t (v_t - S_{t-1}^T k_t) solve the unit lower-triangular
    system (I + A) D = beta * (V - G K S0), A[t, j] = beta_t (G_t / G_j) k_t.k_j (j < t). Then
        O   = G Q S0 + (causal (G_t / G_j) * Q K^T) D
        S_C = G_C S0 + (K * G_C / G)^T D.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    B, L, H, dk = k.shape
    dv = v.shape[-1]
    # [B, H, L, ...] so every chunk is a batch of small matrices.
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)
    s = state.float()
    out = v.new_empty(B, H, L, dv)
    keep = sorted(set(keep_at))
    if keep and (keep[0] < 1 or keep[-1] > L or kept is None):
        raise ValueError(f"keep_at {keep} must lie in [1, {L}] and needs a kept list")
    cuts = sorted(set(range(0, L, chunk_size)) | set(keep) | {L})
    for start, end in zip(cuts[:-1], cuts[1:]):
        n = end - start
        qc, kc, vc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        bc = beta[:, :, start:end]
        gam = g[:, :, start:end].cumsum(-1)  # log G_t
        diff = gam[..., :, None] - gam[..., None, :]  # log(G_t / G_j)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(causal, diff, float("-inf")).exp()  # 0 above the diagonal
        strict = decay.tril(-1)
        kk = kc @ kc.transpose(-1, -2)
        a = bc[..., :, None] * strict * kk
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        rhs = bc[..., None] * (vc - gam.exp()[..., None] * (kc @ s))
        d = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        out[:, :, start:end] = (
            gam.exp()[..., None] * (qc @ s) + (decay * (qc @ kc.transpose(-1, -2))) @ d
        )
        g_last = gam[..., -1:]
        s = (
            g_last.exp()[..., None] * s
            + (kc * (g_last - gam).exp()[..., None]).transpose(-1, -2) @ d
        )
        if end in keep:
            assert kept is not None
            kept.append(s)
    return out.transpose(1, 2), s


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_states: torch.Tensor,
    meta: GDNAttentionMetadata,
    checkpoints: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated delta rule per request over flattened q, k [T, H, dk], v [T, H, dv], g, beta
    [T, H], continuing and updating recurrent_states [S, P, H, dk, dv] (and the checkpoints
    [C, H, dk, dv] the metadata names); returns o [T, H, dv] (float32)."""
    T, H, dv = v.shape
    out = torch.zeros(T, H, dv, dtype=torch.float32, device=v.device)
    init = meta.initial_states(recurrent_states).float()
    grp = meta.short
    if grp is not None:
        # Padding steps have g = 0 and beta = 0: they leave the state unchanged.
        o, kept = recurrent_gated_delta_rule(
            grp.padded(q),
            grp.padded(k),
            grp.padded(v),
            grp.padded(g),
            grp.padded(beta),
            init[grp.rows],
            keep_states=True,
        )
        out[grp.token_flat] = o.reshape(-1, H, dv)[grp.valid]
        recurrent_states[grp.store_slots, grp.store_pos] = kept[grp.store_rows, grp.store_steps].to(
            recurrent_states.dtype
        )
        if grp.ckpt_ids is not None and checkpoints is not None:
            checkpoints[grp.ckpt_ids] = kept[grp.ckpt_rows, grp.ckpt_steps].to(checkpoints.dtype)
    qsl = meta.query_start_loc_np
    for r in meta.long_rows:
        a, b = int(qsl[r]), int(qsl[r + 1])
        writes = meta.long_ckpts.get(r, []) if checkpoints is not None else []
        states: list[torch.Tensor] = []
        o, final = chunked_gated_delta_rule(
            q[a:b][None],
            k[a:b][None],
            v[a:b][None],
            g[a:b][None],
            beta[a:b][None],
            init[r : r + 1],
            keep_at=[off for off, _ in writes],
            kept=states,
        )
        out[a:b] = o[0]
        if writes:
            assert checkpoints is not None
            at = dict(zip(sorted({off for off, _ in writes}), states))
            for off, ck in writes:
                checkpoints[ck] = at[off][0].to(checkpoints.dtype)
        recurrent_states[int(meta.state_slots_np[r]), 0] = final[0].to(recurrent_states.dtype)
    return out
