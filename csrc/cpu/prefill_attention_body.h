// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors
//
// The body of the prefill attention kernel for one instruction set, included once per path by
// prefill_attention.cpp inside a namespace that defines `VecOps` (W fp32 lanes: zero, load,
// store, set1, fma, mul, add, sub, max, exp2, select_neg_inf, is_neg_inf_to_zero) under that
// path's `#pragma GCC target`. No include guard: it is included several times.
//
// One work item = (request, kv head, a tile of query tokens). Its query rows (tokens x the
// heads of the kv-head group, token-major) are scaled by scale * log2(e) and transposed once
// (Qt [Dk, rows]); the keys are walked in tiles of kBK positions whose K and V rows are read in
// place from the paged cache through the block table (fp32; other dtypes are widened into a
// row buffer per tile). Scores are kept transposed, St [keys, rows], so that
//   - St = K Qt is an outer product over the head dimension: MR key rows broadcast, NR query
//     rows as vectors (MR x NR accumulators in registers);
//   - the online softmax runs down the keys with the query rows in the vector lanes (running
//     max and sum per row, base 2), the causal / window bound a per-lane compare;
//   - O += P V broadcasts MR rows of P per key and streams the key's V row as vectors.
// Key tiles past the item's last token are never visited, nor those before its window.

using V = VecOps::V;
constexpr int64_t W = VecOps::W;
constexpr int64_t NR = 2 * W;  // vector columns of a micro-tile: two vectors
// Broadcast rows of a micro-tile: 2 * MR accumulators + 2 loads + 1 broadcast fit the
// registers (16 on AVX2, 32 on AVX512).
constexpr int64_t MR = W == 16 ? 12 : 6;
constexpr int64_t kBK = 8 * MR;  // keys per tile
// Query rows of an item are padded to a multiple of both NR (St columns) and MR (P rows).
constexpr int64_t kRowAlign = W == 16 ? 96 : 48;
static_assert(kRowAlign % NR == 0 && kRowAlign % MR == 0, "row alignment");

// St[MR, NR] (ld lds) = K[MR rows given by pointers, Dk] . Qt[Dk, NR] (ld ldq).
inline void qk_micro(const float* const* __restrict krow, const float* __restrict qt, int64_t ldq,
                     int64_t Dk, float* __restrict st, int64_t lds) {
  V c0[MR], c1[MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) c0[m] = c1[m] = VecOps::zero();
  const float* kp[MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) kp[m] = krow[m];
  for (int64_t d = 0; d < Dk; ++d, qt += ldq) {
    const V b0 = VecOps::load(qt), b1 = VecOps::load(qt + W);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const V a = VecOps::set1(kp[m][d]);
      c0[m] = VecOps::fma(a, b0, c0[m]);
      c1[m] = VecOps::fma(a, b1, c1[m]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    VecOps::store(st + m * lds, c0[m]);
    VecOps::store(st + m * lds + W, c1[m]);
  }
}

// O[MR, NR] (ld ldo) = alpha[m] * O + sum_j Pt[j, m] V[j, col:col + NR] over the nk keys.
inline void pv_micro(const float* __restrict pt, int64_t ldp, const float* const* __restrict vrow,
                     int64_t col, int64_t nk, float* __restrict o, int64_t ldo,
                     const float* __restrict alpha) {
  V c0[MR], c1[MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    const V a = VecOps::set1(alpha[m]);
    c0[m] = VecOps::mul(VecOps::load(o + m * ldo), a);
    c1[m] = VecOps::mul(VecOps::load(o + m * ldo + W), a);
  }
  for (int64_t j = 0; j < nk; ++j, pt += ldp) {
    const float* vp = vrow[j] + col;
    const V b0 = VecOps::load(vp), b1 = VecOps::load(vp + W);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const V a = VecOps::set1(pt[m]);
      c0[m] = VecOps::fma(a, b0, c0[m]);
      c1[m] = VecOps::fma(a, b1, c1[m]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    VecOps::store(o + m * ldo, c0[m]);
    VecOps::store(o + m * ldo + W, c1[m]);
  }
}

struct Scratch {
  std::vector<float> qt, o, st, m, l, alpha, qpos, kbuf, vbuf, zero;
  std::vector<const float*> krow, vrow;
  Scratch(int64_t rows, int64_t Dk, int64_t Dvp)
      : qt(Dk * rows, 0.f),
        o(rows * Dvp, 0.f),
        st(kBK * rows, 0.f),
        m(rows),
        l(rows),
        alpha(rows),
        qpos(rows),
        kbuf(kBK * Dk, 0.f),
        vbuf(kBK * Dvp, 0.f),
        zero(std::max(Dk, Dvp), 0.f),
        krow(kBK),
        vrow(kBK) {}
};

// Widen n values to fp32 (a plain copy for fp32).
template <typename T>
inline void widen(float* __restrict dst, const T* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void run_item(const PrefillArgs& a, const PrefillItem& it, Scratch& sc) {
  const int64_t G = a.G, Dk = a.Dk, Dv = a.Dv, Dvp = (Dv + NR - 1) / NR * NR;
  const int64_t r = it.req, hk = it.hk;
  const int64_t t0 = a.qsl[r], q_len = a.qsl[r + 1] - a.qsl[r], ctx = a.sl[r] - q_len;
  const int64_t nrow = (it.i1 - it.i0) * G;
  const int64_t rows = (nrow + kRowAlign - 1) / kRowAlign * kRowAlign;
  const T* qp = static_cast<const T*>(a.q);
  const T* kp = static_cast<const T*>(a.k);
  const T* vp = static_cast<const T*>(a.v);
  T* op = static_cast<T*>(a.out);
  const int64_t* table = a.bt + r * a.bt_stride;
  const int64_t bs = a.block_size;
  // K / V rows are read in place when they are fp32 and (V) a whole number of vectors wide.
  constexpr bool kFloat = std::is_same_v<T, float>;
  const bool v_in_place = kFloat && Dv == Dvp;

  // Qt [Dk, rows] scaled; padding rows are zero queries at the last token's position.
  float* qt = sc.qt.data();
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t tok = row < nrow ? row / G : (nrow - 1) / G;
    sc.qpos[row] = static_cast<float>(ctx + it.i0 + tok);
    if (row >= nrow) {
      for (int64_t d = 0; d < Dk; ++d) qt[d * rows + row] = 0.f;
      continue;
    }
    const T* src = qp + (t0 + it.i0 + tok) * a.qs0 + (hk * G + row % G) * a.qs1;
    for (int64_t d = 0; d < Dk; ++d) qt[d * rows + row] = static_cast<float>(src[d]) * a.qscale;
  }
  std::fill(sc.o.begin(), sc.o.begin() + rows * Dvp, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + rows, kPaNegInf);
  std::fill(sc.l.begin(), sc.l.begin() + rows, 0.f);

  const int64_t qpos_min = ctx + it.i0, qpos_max = ctx + it.i1 - 1;
  const int64_t kend = qpos_max + 1;  // one past the last key the item's last token sees
  const int64_t kbeg = a.window > 0 ? std::max<int64_t>(0, qpos_min + 1 - a.window) : 0;
  float* st = sc.st.data();
  for (int64_t k0 = kbeg; k0 < kend; k0 += kBK) {
    const int64_t nk = std::min(kBK, kend - k0);
    const int64_t nk_pad = (nk + MR - 1) / MR * MR;
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t pos = k0 + j;
      const int64_t slot = table[pos / bs] * bs + pos % bs;
      const T* ks = kp + slot * a.ks0 + hk * a.ks1;
      const T* vs = vp + slot * a.vs0 + hk * a.vs1;
      if constexpr (kFloat) {
        sc.krow[j] = reinterpret_cast<const float*>(ks);
      } else {
        widen(sc.kbuf.data() + j * Dk, ks, Dk);
        sc.krow[j] = sc.kbuf.data() + j * Dk;
      }
      if (v_in_place) {
        sc.vrow[j] = reinterpret_cast<const float*>(vs);
      } else {
        widen(sc.vbuf.data() + j * Dvp, vs, Dv);  // columns Dv..Dvp stay zero
        sc.vrow[j] = sc.vbuf.data() + j * Dvp;
      }
    }
    for (int64_t j = nk; j < nk_pad; ++j) sc.krow[j] = sc.zero.data();

    // St = K Qt.
    for (int64_t c0 = 0; c0 < rows; c0 += NR)
      for (int64_t j0 = 0; j0 < nk_pad; j0 += MR)
        qk_micro(sc.krow.data() + j0, qt + c0, rows, Dk, st + j0 * rows + c0, rows);

    // Online softmax down the keys, W rows per vector.
    const bool causal_mask = k0 + nk - 1 > qpos_min;
    const bool window_mask = a.window > 0 && k0 <= qpos_max - a.window;
    const V win = VecOps::set1(static_cast<float>(a.window));
    for (int64_t c = 0; c < rows; c += W) {
      const V qpos = VecOps::load(sc.qpos.data() + c);
      V mx = VecOps::set1(kPaNegInf);
      for (int64_t j = 0; j < nk; ++j) {
        float* sp = st + j * rows + c;
        V s = VecOps::load(sp);
        if (causal_mask || window_mask) {
          const V kpos = VecOps::set1(static_cast<float>(k0 + j));
          // Hidden: a key after the query, or window or more positions before it.
          s = VecOps::select_neg_inf(s, kpos, qpos, window_mask, win);
          VecOps::store(sp, s);
        }
        mx = VecOps::max(mx, s);
      }
      const V m_old = VecOps::load(sc.m.data() + c);
      const V m_new = VecOps::max(m_old, mx);
      // A row with no visible key yet keeps m = -inf; exponents are taken against 0 then,
      // so its probabilities (and its rescale factor) are 0, never NaN.
      const V m_use = VecOps::is_neg_inf_to_zero(m_new);
      const V alpha = VecOps::exp2(VecOps::sub(m_old, m_use));
      V sum = VecOps::zero();
      for (int64_t j = 0; j < nk; ++j) {
        float* sp = st + j * rows + c;
        const V p = VecOps::exp2(VecOps::sub(VecOps::load(sp), m_use));
        VecOps::store(sp, p);
        sum = VecOps::add(sum, p);
      }
      VecOps::store(sc.m.data() + c, m_new);
      VecOps::store(sc.alpha.data() + c, alpha);
      VecOps::store(sc.l.data() + c, VecOps::fma(VecOps::load(sc.l.data() + c), alpha, sum));
    }

    // O = alpha O + P V.
    for (int64_t m0 = 0; m0 < rows; m0 += MR)
      for (int64_t c = 0; c < Dvp; c += NR)
        pv_micro(st + m0, rows, sc.vrow.data(), c, nk, sc.o.data() + m0 * Dvp + c, Dvp,
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
  Scratch sc((rows_cap + kRowAlign - 1) / kRowAlign * kRowAlign, a.Dk, Dvp);
  const int64_t n = static_cast<int64_t>(items.size());
  for (int64_t idx = next.fetch_add(1); idx < n; idx = next.fetch_add(1))
    run_item<T>(a, items[idx], sc);
}
