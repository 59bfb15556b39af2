// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors
//
// The body of the prefill attention kernel for one instruction set, included once per path by
// prefill_attention.cpp inside a namespace that defines `VecOps` (W fp32 lanes: zero, load,
// store, set1, fma, mul, sub, max, hmax, hsum, exp2) under that path's `#pragma GCC target`.
// No include guard: it is meant to be included several times.
//
// One work item = (request, kv head, a tile of query tokens). Its query rows (tokens x the
// heads of the kv-head group, token-major) are scaled by scale * log2(e) once; the keys are
// walked in tiles of kBK positions gathered from the paged cache through the block table (K
// transposed, V as rows, both widened to fp32), and each key tile costs two register-blocked
// products (S = Q K^T as an outer product over the head dimension, O += P V over the keys)
// with an online softmax between them (running max and sum per row, base 2). Causality is a
// per-row bound (row of token i sees positions <= ctx + i; key tiles past the item's last
// token are never visited), the sliding window a per-row lower bound.

using V = VecOps::V;
constexpr int64_t W = VecOps::W;
constexpr int64_t NR = 2 * W;  // columns of one micro-tile: two vectors
// Rows of one micro-tile: 2 * MR accumulators + 2 key vectors + 1 broadcast fit the registers
// (16 on AVX2, 32 on AVX512).
constexpr int64_t MR = W == 16 ? 12 : 6;
constexpr int64_t kBK = 64;  // keys per tile (a multiple of NR)
static_assert(kBK % NR == 0, "key tile");

// S[MR, ncols] (ld kBK) = Q[MR, D] (ld D) . Kt[D, ncols] (ld kBK); ncols a multiple of NR.
inline void qk_tile(const float* __restrict q, int64_t D, const float* __restrict kt,
                    int64_t ncols, float* __restrict s) {
  for (int64_t c = 0; c < ncols; c += NR) {
    V c0[MR], c1[MR];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) c0[m] = c1[m] = VecOps::zero();
    const float* kp = kt + c;
    for (int64_t d = 0; d < D; ++d, kp += kBK) {
      const V b0 = VecOps::load(kp), b1 = VecOps::load(kp + W);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const V a = VecOps::set1(q[m * D + d]);
        c0[m] = VecOps::fma(a, b0, c0[m]);
        c1[m] = VecOps::fma(a, b1, c1[m]);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      VecOps::store(s + m * kBK + c, c0[m]);
      VecOps::store(s + m * kBK + c + W, c1[m]);
    }
  }
}

// O[MR, Dvp] (ld Dvp) = alpha[m] * O + P[MR, nk] (ld kBK) . Vt[nk, Dvp] (ld Dvp).
inline void pv_tile(const float* __restrict p, const float* __restrict vt, int64_t nk,
                    float* __restrict o, int64_t Dvp, const float* __restrict alpha) {
  for (int64_t c = 0; c < Dvp; c += NR) {
    V c0[MR], c1[MR];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const V a = VecOps::set1(alpha[m]);
      c0[m] = VecOps::mul(VecOps::load(o + m * Dvp + c), a);
      c1[m] = VecOps::mul(VecOps::load(o + m * Dvp + c + W), a);
    }
    const float* vp = vt + c;
    for (int64_t j = 0; j < nk; ++j, vp += Dvp) {
      const V b0 = VecOps::load(vp), b1 = VecOps::load(vp + W);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const V a = VecOps::set1(p[m * kBK + j]);
        c0[m] = VecOps::fma(a, b0, c0[m]);
        c1[m] = VecOps::fma(a, b1, c1[m]);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      VecOps::store(o + m * Dvp + c, c0[m]);
      VecOps::store(o + m * Dvp + c + W, c1[m]);
    }
  }
}

// Row `s` of a key tile: mask to the visible keys [lo, hi), then the online-softmax update.
// Returns the factor the row's accumulator is rescaled by; s becomes the row's probabilities.
inline float softmax_row(float* __restrict s, int64_t ncols, int64_t lo, int64_t hi,
                         float* __restrict m_row, float* __restrict l_row) {
  if (hi <= lo) {  // no visible key in this tile (sliding window): leave the row as it was
    for (int64_t j = 0; j < ncols; ++j) s[j] = 0.f;
    return 1.f;
  }
  for (int64_t j = 0; j < lo; ++j) s[j] = kPaNegInf;
  for (int64_t j = hi; j < ncols; ++j) s[j] = kPaNegInf;
  V mx = VecOps::set1(kPaNegInf);
  for (int64_t j = 0; j < ncols; j += W) mx = VecOps::max(mx, VecOps::load(s + j));
  const float m_old = *m_row;
  const float m_new = std::max(m_old, VecOps::hmax(mx));
  const float alpha = m_old == kPaNegInf ? 0.f : std::exp2(m_old - m_new);
  const V mv = VecOps::set1(m_new);
  V sum = VecOps::zero();
  for (int64_t j = 0; j < ncols; j += W) {
    const V p = VecOps::exp2(VecOps::sub(VecOps::load(s + j), mv));
    VecOps::store(s + j, p);
    sum = VecOps::add(sum, p);
  }
  *m_row = m_new;
  *l_row = *l_row * alpha + VecOps::hsum(sum);
  return alpha;
}

struct Scratch {
  std::vector<float> q, o, s, kt, vt, m, l, alpha;
  Scratch(int64_t rows, int64_t Dk, int64_t Dvp)
      : q(rows * Dk, 0.f),
        o(rows * Dvp, 0.f),
        s(rows * kBK, 0.f),
        kt(Dk * kBK, 0.f),
        vt(kBK * Dvp, 0.f),
        m(rows),
        l(rows),
        alpha(rows, 1.f) {}
};

template <typename T>
void run_item(const PrefillArgs& a, const PrefillItem& it, Scratch& sc) {
  const int64_t G = a.G, Dk = a.Dk, Dv = a.Dv, Dvp = (Dv + NR - 1) / NR * NR;
  const int64_t r = it.req, hk = it.hk;
  const int64_t t0 = a.qsl[r], q_len = a.qsl[r + 1] - a.qsl[r], ctx = a.sl[r] - q_len;
  const int64_t nrow = (it.i1 - it.i0) * G, nrow_pad = (nrow + MR - 1) / MR * MR;
  const T* qp = static_cast<const T*>(a.q);
  const T* kp = static_cast<const T*>(a.k);
  const T* vp = static_cast<const T*>(a.v);
  T* op = static_cast<T*>(a.out);
  const int64_t* table = a.bt + r * a.bt_stride;
  const int64_t bs = a.block_size;

  float* qb = sc.q.data();
  for (int64_t row = 0; row < nrow; ++row) {
    const int64_t i = it.i0 + row / G, h = hk * G + row % G;
    const T* src = qp + (t0 + i) * a.qs0 + h * a.qs1;
    float* dst = qb + row * Dk;
    for (int64_t d = 0; d < Dk; ++d) dst[d] = static_cast<float>(src[d]) * a.qscale;
  }
  std::fill(qb + nrow * Dk, qb + nrow_pad * Dk, 0.f);
  std::fill(sc.o.begin(), sc.o.begin() + nrow_pad * Dvp, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + nrow, kPaNegInf);
  std::fill(sc.l.begin(), sc.l.begin() + nrow, 0.f);
  std::fill(sc.alpha.begin(), sc.alpha.begin() + nrow_pad, 1.f);

  const int64_t kend = ctx + it.i1;  // one past the last key the item's last token sees
  const int64_t kbeg = a.window > 0 ? std::max<int64_t>(0, ctx + it.i0 + 1 - a.window) : 0;
  for (int64_t k0 = kbeg; k0 < kend; k0 += kBK) {
    const int64_t nk = std::min(kBK, kend - k0);
    // Gather the tile's keys (transposed) and values from their cache blocks.
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t pos = k0 + j;
      const int64_t slot = table[pos / bs] * bs + pos % bs;
      const T* ks = kp + slot * a.ks0 + hk * a.ks1;
      for (int64_t d = 0; d < Dk; ++d) sc.kt[d * kBK + j] = static_cast<float>(ks[d]);
      const T* vs = vp + slot * a.vs0 + hk * a.vs1;
      float* vd = sc.vt.data() + j * Dvp;
      for (int64_t d = 0; d < Dv; ++d) vd[d] = static_cast<float>(vs[d]);
    }
    const int64_t ncols = (nk + NR - 1) / NR * NR;
    for (int64_t m0 = 0; m0 < nrow_pad; m0 += MR)
      qk_tile(qb + m0 * Dk, Dk, sc.kt.data(), ncols, sc.s.data() + m0 * kBK);
    const int64_t ncols_w = (nk + W - 1) / W * W;
    for (int64_t row = 0; row < nrow; ++row) {
      const int64_t qpos = ctx + it.i0 + row / G;  // the row's absolute position
      const int64_t hi = std::min(nk, qpos + 1 - k0);
      const int64_t lo = a.window > 0 ? std::max<int64_t>(0, qpos + 1 - a.window - k0) : 0;
      sc.alpha[row] = softmax_row(sc.s.data() + row * kBK, ncols_w, lo, hi, &sc.m[row], &sc.l[row]);
    }
    for (int64_t m0 = 0; m0 < nrow_pad; m0 += MR)
      pv_tile(sc.s.data() + m0 * kBK, sc.vt.data(), nk, sc.o.data() + m0 * Dvp, Dvp,
              sc.alpha.data() + m0);
  }
  for (int64_t row = 0; row < nrow; ++row) {
    const int64_t i = it.i0 + row / G, h = hk * G + row % G;
    T* dst = op + (t0 + i) * a.os0 + h * a.os1;
    const float* src = sc.o.data() + row * Dvp;
    const float inv = 1.f / sc.l[row];
    for (int64_t d = 0; d < Dv; ++d) dst[d] = static_cast<T>(src[d] * inv);
  }
}

// Run items until none is left (items are taken in order: the costliest first).
template <typename T>
void run_items(const PrefillArgs& a, const std::vector<PrefillItem>& items,
               std::atomic<int64_t>& next, int64_t rows_cap) {
  const int64_t Dvp = (a.Dv + NR - 1) / NR * NR;
  Scratch sc((rows_cap + MR - 1) / MR * MR, a.Dk, Dvp);
  const int64_t n = static_cast<int64_t>(items.size());
  for (int64_t idx = next.fetch_add(1); idx < n; idx = next.fetch_add(1))
    run_item<T>(a, items[idx], sc);
}
