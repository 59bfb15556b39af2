// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors
//
// Paged attention on CPU: queries attend to keys/values read straight from the paged KV cache
// through each request's block table, instead of gathering every request's context into padded
// [R, S] tensors in every layer. One kernel serves decode, draft verification (short multi-token
// queries), chunked prefill and prefill, GQA/MQA (any num_heads / num_kv_heads ratio) and MLA's
// absorbed single-KV-head form (keys = the latent cache row, values = its first kv_lora_rank
// channels, a strided view of the same cache).
//
// Work item = (request, kv head, key split). All query heads of a kv-head group and all query
// tokens of the request share each K/V row the item loads, so the cache is streamed once per
// group. Keys are walked one cache block at a time with an online (running max) softmax in fp32;
// long contexts are split over several items (flash-decoding) whose partial results are merged
// at the end, so that a batch-1 decode still spreads over all threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "elem.h"
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, const float* __restrict x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scale_in_place(float* __restrict y, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// Rows to and from fp32 through elem.h's conversions (bf16 as its bits: they vectorize).
template <typename T>
inline void load_row(float* __restrict dst, const T* __restrict src, int64_t n) {
  using E = vllm_cpu::Elem<T>;
  const auto* s = reinterpret_cast<const typename E::S*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = E::load(s[i]);
}

template <typename T>
inline void store_row(T* __restrict dst, const float* __restrict src, float mul, int64_t n) {
  using E = vllm_cpu::Elem<T>;
  auto* d = reinterpret_cast<typename E::S*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = E::store(src[i] * mul);
}

#if defined(__AVX512F__)
// exp(x) for x <= 0 over 16 lanes (std::exp is a scalar libm call per score): x = n ln2 + r,
// |r| <= ln2 / 2, e^r by a degree-6 polynomial (Cephes' expf coefficients, ~1 ulp), times 2^n
// built in the exponent bits. exp(-inf) = 0 exactly (masked keys add nothing); below -87.3
// (e^x under 1e-38) the result is that limit's value, against a max term of 1.
inline __m512 exp_nonpos16(__m512 x) {
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 v = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(x, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ),
                            _mm512_setzero_ps());
}
#endif

// One query row against up to kChunk keys of a block, head size D (a multiple of 16): the
// keys transposed once per chunk (kt[d * kChunk + j], shared by every query row of the item)
// so that each row's kChunk scores are one vector of FMAs over d (four partial sums, no
// horizontal sum per key); then the online softmax step and acc += P V with each 16 channels
// of acc held in a register over the chunk's keys.
constexpr int64_t kChunk = 16;

#if defined(__AVX512F__)
// 16 x 16 floats transposed in registers (unpack pairs, then 64-bit pairs, then 128-bit lanes
// twice): 64 shuffles where a scalar copy takes 256 strided stores.
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] =
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] =
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(
        _mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}
#endif

#if defined(__AVX512F__)
// 16 cache values as fp32 (bf16 and fp16 widen exactly), straight from the cache.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is fp32's top half
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

template <int D, typename T>
inline void transpose_keys(float* __restrict kt, const T* __restrict kb, int64_t kstride,
                           int64_t n_keys) {
#if defined(__AVX512F__)
  static_assert(kChunk == 16);
  for (int c = 0; c < D; c += 16) {
    __m512 r[16];
    for (int64_t j = 0; j < 16; ++j)
      r[j] = j < n_keys ? load16(kb + j * kstride + c) : _mm512_setzero_ps();
    transpose16(r);
    for (int t = 0; t < 16; ++t) _mm512_storeu_ps(kt + (c + t) * kChunk, r[t]);
  }
#else
  TORCH_CHECK(false, "paged_attention: the chunked path is built for AVX512 only");
#endif
}

// RB query rows of one query token (heads of one kv-head group: the same keys visible, mask
// `vis`, `visible` of them) against up to kChunk keys of a block, head size D (a multiple of
// 16). The keys were transposed once per chunk (kt[d * kChunk + j], shared by every query row
// of the item) so that each row's kChunk scores are one vector of FMAs over d in four partial
// sums; then each row's online softmax step, and acc += P V with every (row, 16 channels)
// accumulator held in a register over the chunk's keys. The RB rows share every key and value
// vector loaded and interleave their independent FMA chains (one row alone waits on its own
// chain's latency); each row's arithmetic is the same whatever RB is (the same partial sums in
// the same order, the same softmax step, the same FMAs over the keys in order), so a row's
// result never depends on which rows share its tile. A row that sees none of the chunk's keys
// keeps m, l and acc as they were.
template <int D, int RB, typename T>
inline void attend_rows(const float* __restrict qr, int64_t qstride, const float* __restrict kt,
                        const T* __restrict vb, int64_t vstride, uint32_t vis,
                        int64_t visible, float* __restrict m, float* __restrict l,
                        float* __restrict acc, int64_t astride) {
  static_assert(D % 16 == 0 && D >= 16, "head size");
  static_assert(kChunk == 16 && RB >= 1 && RB <= 4);
#if defined(__AVX512F__)
  __m512 s[RB][4];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) s[r][0] = s[r][1] = s[r][2] = s[r][3] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 4) {
    __m512 k0 = _mm512_loadu_ps(kt + d * kChunk);
    __m512 k1 = _mm512_loadu_ps(kt + (d + 1) * kChunk);
    __m512 k2 = _mm512_loadu_ps(kt + (d + 2) * kChunk);
    __m512 k3 = _mm512_loadu_ps(kt + (d + 3) * kChunk);
    // In registers, so that each row's q[d] is an embedded broadcast of its FMA (GCC would
    // otherwise fold these loads into every FMA and broadcast q[d] on the FP pipes).
    asm("" : "+v"(k0), "+v"(k1), "+v"(k2), "+v"(k3));
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const float* q = qr + r * qstride + d;
      s[r][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[0]), k0, s[r][0]);
      s[r][1] = _mm512_fmadd_ps(_mm512_set1_ps(q[1]), k1, s[r][1]);
      s[r][2] = _mm512_fmadd_ps(_mm512_set1_ps(q[2]), k2, s[r][2]);
      s[r][3] = _mm512_fmadd_ps(_mm512_set1_ps(q[3]), k3, s[r][3]);
    }
  }
  const __mmask16 vm = static_cast<__mmask16>(vis);
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  alignas(64) float pr[RB][kChunk];
  float alpha[RB];
  bool any_live = false;
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r) {
    const __m512 sum4 =
        _mm512_add_ps(_mm512_add_ps(s[r][0], s[r][1]), _mm512_add_ps(s[r][2], s[r][3]));
    const __m512 sc = _mm512_mask_mov_ps(ninf, vm, sum4);
    const float bmax = _mm512_reduce_max_ps(sc);
    alpha[r] = 1.f;
    if (bmax == kNegInf) {
      _mm512_store_ps(pr[r], _mm512_setzero_ps());
      continue;
    }
    any_live = true;
    const float m_new = std::max(m[r], bmax);
    alpha[r] = m[r] == kNegInf ? 0.f : std::exp(m[r] - m_new);
    m[r] = m_new;
    const __m512 pv = exp_nonpos16(_mm512_sub_ps(sc, _mm512_set1_ps(m_new)));
    _mm512_store_ps(pr[r], pv);
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(pv);
  }
  // The tile's rows share one mask, so they see keys of this chunk all or none.
  if (!any_live) return;
  // acc += P V, CB blocks of 16 channels at a time (RB x CB accumulators in registers). A row
  // that saw nothing would have P = 0 and alpha = 1: its accumulators come back unchanged.
  constexpr int CB = std::min(D / 16, 16 / RB);
  for (int c = 0; c < D; c += CB * 16) {
    __m512 a[RB][CB];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 16
      for (int b = 0; b < CB; ++b) {
        a[r][b] = _mm512_loadu_ps(acc + r * astride + c + b * 16);
        if (alpha[r] != 1.f) a[r][b] = _mm512_mul_ps(a[r][b], _mm512_set1_ps(alpha[r]));
      }
    }
    for (int64_t j = 0; j < visible; ++j) {
      __m512 v[CB];
#pragma GCC unroll 16
      for (int b = 0; b < CB; ++b) v[b] = load16(vb + j * vstride + c + b * 16);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        const __m512 p = _mm512_set1_ps(pr[r][j]);
#pragma GCC unroll 16
        for (int b = 0; b < CB; ++b) a[r][b] = _mm512_fmadd_ps(p, v[b], a[r][b]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
#pragma GCC unroll 16
      for (int b = 0; b < CB; ++b) _mm512_storeu_ps(acc + r * astride + c + b * 16, a[r][b]);
    }
  }
#else
  TORCH_CHECK(false, "paged_attention: the chunked path is built for AVX512 only");
#endif
}

struct Split {
  int64_t req;          // index into query_start_loc / seq_lens / block_table
  int64_t block_begin;  // logical cache blocks [block_begin, block_end) of this item
  int64_t block_end;
  int64_t part;  // slot in the partial-result buffers, -1 when this item owns the request
};

template <typename scalar_t, int D>
void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
         const at::Tensor& query_start_loc, const at::Tensor& rows, int64_t block_size,
         double scale_d, int64_t blocks_per_split, const uint8_t* tree, int64_t tree_m) {
  const int64_t H = q.size(1), Dk = q.size(2);
  const int64_t Hkv = k_cache.size(1), Dv = v_cache.size(2);
  const int64_t G = H / Hkv;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t bt_stride = block_table.stride(0), max_blocks = block_table.size(1);
  const float scale = static_cast<float>(scale_d);

  const scalar_t* qp = q.const_data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.const_data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.const_data_ptr<scalar_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const int64_t* bt = block_table.const_data_ptr<int64_t>();
  const int64_t* sl = seq_lens.const_data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.const_data_ptr<int64_t>();
  const int64_t* rp = rows.const_data_ptr<int64_t>();
  const int64_t num_rows = rows.numel();

  // Split long contexts so that there are a few items per thread (flash-decoding).
  std::vector<Split> splits;
  splits.reserve(num_rows);
  int64_t total_blocks = 0;
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t r = rp[i];
    const int64_t nb = (sl[r] + block_size - 1) / block_size;
    TORCH_CHECK(nb <= max_blocks, "request ", r, " has ", sl[r], " tokens but its block table ",
                "holds only ", max_blocks, " blocks of ", block_size);
    TORCH_CHECK(qsl[r + 1] - qsl[r] <= sl[r], "request ", r, " has more query tokens (",
                qsl[r + 1] - qsl[r], ") than tokens (", sl[r], ")");
    total_blocks += nb;
  }
  int64_t bps = blocks_per_split;
  if (bps <= 0) {
    const int64_t threads = static_cast<int64_t>(at::get_num_threads());
    const int64_t items_now = std::max<int64_t>(num_rows * Hkv, 1);
    const int64_t per_row = std::max<int64_t>(total_blocks / std::max<int64_t>(num_rows, 1), 1);
    // Split while there are fewer than ~4 items per thread, into parts of at least
    // kMinSplitBlocks blocks: merging partials takes a second parallel region, which costs
    // more than it saves below ~400 keys a part (2 threads, SmolLM2's heads: a decode or a
    // 4-token verify at 160-300 keys ran 20-50% slower split in 8-block parts). Then an item
    // count the threads share evenly (3 kv heads on 2 threads: 2 parts each, not 3).
    constexpr int64_t kMinSplitBlocks = 24;
    int64_t nsplit = 1;
    if (threads > 1 && items_now < 4 * threads) {
      nsplit = std::min((4 * threads + items_now - 1) / items_now, per_row / kMinSplitBlocks);
      while (nsplit > 1 && (items_now * nsplit) % threads != 0) --nsplit;
      nsplit = std::max<int64_t>(nsplit, 1);
    }
    bps = (per_row + nsplit - 1) / nsplit;
  }
  int64_t num_parts = 0;
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t r = rp[i];
    const int64_t nb = (sl[r] + block_size - 1) / block_size;
    if (nb <= bps) {
      splits.push_back({r, 0, nb, -1});
      continue;
    }
    for (int64_t b = 0; b < nb; b += bps) {
      splits.push_back({r, b, std::min(b + bps, nb), num_parts});
      num_parts += qsl[r + 1] - qsl[r];  // one partial row per query token (x H heads)
    }
  }
  // Partial results of split requests: [num_parts, H, Dv] accumulators, [num_parts, H] max/sum.
  std::vector<float> part_acc(static_cast<size_t>(num_parts * H * Dv));
  std::vector<float> part_m(static_cast<size_t>(num_parts * H), kNegInf);
  std::vector<float> part_l(static_cast<size_t>(num_parts * H), 0.f);

  const int64_t num_items = static_cast<int64_t>(splits.size()) * Hkv;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    // Scratch of the chunked path (kt) or of the generic one (scores; kbuf / vbuf: a block
    // converted to fp32).
    std::vector<float> qbuf, acc, m, l, kt(D > 0 ? D * kChunk : 0);
    std::vector<float> kbuf(D > 0 ? 0 : block_size * Dk), vbuf(D > 0 ? 0 : block_size * Dv),
        scores(D > 0 ? 0 : block_size);
    for (int64_t item = begin; item < end; ++item) {
      const Split& sp = splits[item / Hkv];
      const int64_t hk = item % Hkv;
      const int64_t r = sp.req;
      const int64_t t0 = qsl[r], q_len = qsl[r + 1] - qsl[r];
      const int64_t ctx = sl[r] - q_len;
      const int64_t nq = q_len * G;  // query rows: token-major, then head within the group
      qbuf.assign(nq * Dk, 0.f);
      acc.assign(nq * Dv, 0.f);
      m.assign(nq, kNegInf);
      l.assign(nq, 0.f);
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t g = 0; g < G; ++g) {
          float* dst = &qbuf[(i * G + g) * Dk];
          load_row(dst, qp + (t0 + i) * qs0 + (hk * G + g) * qs1, Dk);
          scale_in_place(dst, scale, Dk);
        }
      const int64_t* table = bt + r * bt_stride;
      for (int64_t b = sp.block_begin; b < sp.block_end; ++b) {
        const int64_t first = b * block_size;
        // Keys of this block that the last query token may see (causal; no padding).
        const int64_t n_keys = std::min(block_size, ctx + q_len - first);
        if (n_keys <= 0) break;
        const int64_t slot0 = table[b] * block_size;
        if constexpr (D > 0) {
          // Chunks of kChunk keys, read from the cache in its dtype (widened in registers):
          // transposed once, then every query row of the item.
          const scalar_t* kb = kp + slot0 * ks0 + hk * ks1;
          const scalar_t* vb = vp + slot0 * vs0 + hk * vs1;
          const int64_t kstride = ks0, vstride = vs0;
          for (int64_t c0 = 0; c0 < n_keys; c0 += kChunk) {
            const int64_t nk = std::min(kChunk, n_keys - c0);
            if (ctx + q_len - 1 < first + c0) break;  // no row sees this chunk (causal)
            transpose_keys<D>(kt.data(), kb + c0 * kstride, kstride, nk);
            for (int64_t i = 0; i < q_len; ++i) {
              const int64_t visible = std::min(nk, ctx + i + 1 - first - c0);
              if (visible <= 0) continue;
              uint32_t vis = 0;  // bit j: key c0 + j is visible to this row
              const uint8_t* bits = tree ? tree + (r * tree_m + i) * tree_m : nullptr;
              for (int64_t j = 0; j < visible; ++j) {
                const int64_t p = first + c0 + j;
                vis |= static_cast<uint32_t>(bits == nullptr || p < ctx || bits[p - ctx]) << j;
              }
              // The group's heads of token i, up to 4 rows per tile.
              for (int64_t g0 = 0; g0 < G; g0 += 4) {
                const int64_t row = i * G + g0;
                auto tile = [&](auto rb) {
                  attend_rows<D, decltype(rb)::value, scalar_t>(&qbuf[row * Dk], Dk, kt.data(),
                                                      vb + c0 * vstride, vstride, vis, visible,
                                                      &m[row], &l[row], &acc[row * Dv], Dv);
                };
                switch (std::min<int64_t>(G - g0, 4)) {
                  case 1:
                    tile(std::integral_constant<int, 1>{});
                    break;
                  case 2:
                    tile(std::integral_constant<int, 2>{});
                    break;
                  case 3:
                    tile(std::integral_constant<int, 3>{});
                    break;
                  default:
                    tile(std::integral_constant<int, 4>{});
                }
              }
            }
          }
          continue;
        }
        // The generic path: the block's keys and values as fp32 rows.
        const float *kb, *vb;
        int64_t kstride, vstride;
        if constexpr (std::is_same_v<scalar_t, float>) {
          kb = kp + slot0 * ks0 + hk * ks1, kstride = ks0;  // read in place
          vb = vp + slot0 * vs0 + hk * vs1, vstride = vs0;
        } else {
          for (int64_t j = 0; j < n_keys; ++j) {
            load_row(&kbuf[j * Dk], kp + (slot0 + j) * ks0 + hk * ks1, Dk);
            load_row(&vbuf[j * Dv], vp + (slot0 + j) * vs0 + hk * vs1, Dv);
          }
          kb = kbuf.data(), kstride = Dk;
          vb = vbuf.data(), vstride = Dv;
        }
        for (int64_t i = 0; i < q_len; ++i) {
          const int64_t visible = std::min(n_keys, ctx + i + 1 - first);
          if (visible <= 0) continue;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t row = i * G + g;
            const float* qr = &qbuf[row * Dk];
            float bmax = kNegInf;
            if (tree == nullptr) {
              for (int64_t j = 0; j < visible; ++j) {
                scores[j] = dot(qr, kb + j * kstride, Dk);
                bmax = std::max(bmax, scores[j]);
              }
            } else {
              // Tree: of the step's keys (positions >= ctx) only row i's ancestors and itself;
              // rows are in topological order, so none lies past `visible`.
              const uint8_t* bits = tree + (r * tree_m + i) * tree_m;
              for (int64_t j = 0; j < visible; ++j) {
                const int64_t p = first + j;
                scores[j] = p < ctx || bits[p - ctx] ? dot(qr, kb + j * kstride, Dk) : kNegInf;
                bmax = std::max(bmax, scores[j]);
              }
              if (bmax == kNegInf) continue;  // nothing visible in this block
            }
            const float m_new = std::max(m[row], bmax);
            const float alpha = m[row] == kNegInf ? 0.f : std::exp(m[row] - m_new);
            m[row] = m_new;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < visible; ++j) {
              scores[j] = std::exp(scores[j] - m_new);
              sum += scores[j];
            }
            l[row] = l[row] * alpha + sum;
            // acc = alpha * acc + P V, with each output channel kept in a register over keys.
            float* a = &acc[row * Dv];
            if (alpha != 1.f) scale_in_place(a, alpha, Dv);
            if (tree == nullptr) {
              for (int64_t j = 0; j < visible; ++j) axpy(a, vb + j * vstride, scores[j], Dv);
            } else {
              for (int64_t j = 0; j < visible; ++j)
                if (scores[j] != 0.f) axpy(a, vb + j * vstride, scores[j], Dv);
            }
          }
        }
      }
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t row = i * G + g, h = hk * G + g;
          if (sp.part < 0) {
            // l == 0: a tree row that sees nothing (no context) gets zeros, not NaN.
            store_row(op + (t0 + i) * os0 + h * os1, &acc[row * Dv],
                      l[row] > 0.f ? 1.f / l[row] : 0.f, Dv);
          } else {
            const int64_t pr = (sp.part + i) * H + h;
            std::copy_n(&acc[row * Dv], Dv, &part_acc[pr * Dv]);
            part_m[pr] = m[row];
            part_l[pr] = l[row];
          }
        }
    }
  });
  if (num_parts == 0) return;

  // Merge the splits of each split request: rescale every partial to the common max.
  std::vector<int64_t> first_split;  // index into splits of each split request's first item
  for (int64_t s = 0; s < static_cast<int64_t>(splits.size()); ++s)
    if (splits[s].part >= 0 && (s == 0 || splits[s - 1].req != splits[s].req ||
                                splits[s - 1].part < 0))
      first_split.push_back(s);
  at::parallel_for(0, static_cast<int64_t>(first_split.size()) * H, 1, [&](int64_t b, int64_t e) {
    std::vector<float> merged(Dv);
    for (int64_t w = b; w < e; ++w) {
      const int64_t s0 = first_split[w / H], h = w % H;
      const int64_t r = splits[s0].req;
      const int64_t t0 = qsl[r], q_len = qsl[r + 1] - qsl[r];
      int64_t s1 = s0;
      while (s1 < static_cast<int64_t>(splits.size()) && splits[s1].req == r) ++s1;
      for (int64_t i = 0; i < q_len; ++i) {
        float mx = kNegInf;
        for (int64_t s = s0; s < s1; ++s) mx = std::max(mx, part_m[(splits[s].part + i) * H + h]);
        std::fill(merged.begin(), merged.end(), 0.f);
        float total = 0.f;
        for (int64_t s = s0; s < s1; ++s) {
          const int64_t pr = (splits[s].part + i) * H + h;
          if (part_m[pr] == kNegInf) continue;  // no visible key in this split
          const float w_s = std::exp(part_m[pr] - mx);
          total += part_l[pr] * w_s;
          axpy(merged.data(), &part_acc[pr * Dv], w_s, Dv);
        }
        store_row(op + (t0 + i) * os0 + h * os1, merged.data(), total > 0.f ? 1.f / total : 0.f,
                  Dv);
      }
    }
  });
}

}  // namespace

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& rows, int64_t block_size, double scale,
                     int64_t blocks_per_split, const c10::optional<at::Tensor>& tree_mask) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && out.dim() == 3,
              "paged_attention: q [T, H, Dk], k_cache [slots, Hkv, Dk], v_cache [slots, Hkv, Dv],"
              " out [T, H, Dv]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "paged_attention: q, caches and out must share one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1 &&
                  out.stride(2) == 1,
              "paged_attention: the head dimension must be contiguous");
  TORCH_CHECK(k_cache.size(1) == v_cache.size(1) && k_cache.size(2) == q.size(2) &&
                  q.size(1) % k_cache.size(1) == 0 && out.size(1) == q.size(1) &&
                  out.size(2) == v_cache.size(2) && out.size(0) == q.size(0),
              "paged_attention: inconsistent shapes");
  for (const at::Tensor* t : {&block_table, &seq_lens, &query_start_loc, &rows})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_attention: metadata must be contiguous int64");
  TORCH_CHECK(block_size > 0, "paged_attention: block_size must be positive");
  const uint8_t* tree = nullptr;
  int64_t tree_m = 0;
  if (tree_mask.has_value()) {
    const at::Tensor& tm = *tree_mask;
    TORCH_CHECK((tm.scalar_type() == at::kBool || tm.scalar_type() == at::kChar ||
                 tm.scalar_type() == at::kByte) &&
                    tm.dim() == 3 && tm.size(1) == tm.size(2) && tm.is_contiguous(),
                "paged_attention: tree_mask must be a contiguous bool / int8 [R, M, M]");
    tree_m = tm.size(1);
    const int64_t* qsl = query_start_loc.const_data_ptr<int64_t>();
    const int64_t* rp = rows.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.numel(); ++i) {
      TORCH_CHECK(rp[i] < tm.size(0), "paged_attention: tree_mask has ", tm.size(0),
                  " requests, no entry for request ", rp[i]);
      TORCH_CHECK(qsl[rp[i] + 1] - qsl[rp[i]] <= tree_m, "paged_attention: request ", rp[i],
                  " has more query tokens than the tree mask's ", tree_m, " rows");
    }
    tree = static_cast<const uint8_t*>(tm.const_data_ptr());
  }
  // Head sizes of 32, 64 and 128 (keys and values alike) take the chunked path where the build
  // has AVX512 (-march=native on such a CPU); others (MLA's absorbed latent, odd sizes) and
  // other CPUs the generic one.
  const int64_t Dk = q.size(2), Dv = v_cache.size(2);
#if defined(__AVX512F__)
  const int D = Dk == Dv && (Dk == 32 || Dk == 64 || Dk == 128) ? static_cast<int>(Dk) : 0;
#else
  const int D = 0;
#endif
  auto go = [&](auto tag) {
    using scalar_t = decltype(tag);
    auto call = [&](auto d) {
      run<scalar_t, decltype(d)::value>(out, q, k_cache, v_cache, block_table, seq_lens,
                                        query_start_loc, rows, block_size, scale,
                                        blocks_per_split, tree, tree_m);
    };
    switch (D) {
      case 32:
        return call(std::integral_constant<int, 32>{});
      case 64:
        return call(std::integral_constant<int, 64>{});
      case 128:
        return call(std::integral_constant<int, 128>{});
      default:
        return call(std::integral_constant<int, 0>{});
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat:
      return go(float{});
    case at::kBFloat16:
      return go(c10::BFloat16{});
    case at::kHalf:
      return go(c10::Half{});
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
}
