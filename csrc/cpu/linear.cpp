// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors
//
// y = x @ W^T (+ b) for the few rows of a decode / verify / draft step (small M), W [N, K] and
// x [M, K] both fp32 or both bf16, accumulated in fp32, rounded to x's dtype once.
//
// With M this small the product is bound by streaming W from memory: a block of kNR weight rows
// is read from memory once and multiplied against every row of x (tiles of MR rows) while it
// sits in L1, so a verify step's M = 4 rows cost about what one row costs.
//
// Batch invariance by construction: output element (m, n) is always one vector accumulator
// running over k in the same order (whole vectors, then the zero-padded tail), then the same
// horizontal sum, then + bias and one rounding - whatever M is, whichever rows share the call
// and however the output columns are split across threads. Tiles only change how many
// independent accumulators are live at once, never the arithmetic of any one of them.
//
// The instruction set is chosen at run time (cpuid), each path compiled with its own target
// attribute, so one build runs on AVX2-only and AVX512-BF16 machines alike:
//   4 avx512bf16: bf16 pairs with vdpbf16ps (fp32 weights: the avx512 path)
//   3 avx512:     AVX512F(+BW, VL) FMA over 16 fp32 lanes (bf16 widened in registers)
//   2 avx2:       AVX2 + FMA over 8 fp32 lanes
//   1 portable:   plain C++ over 8 fp32 partial sums
// Each path is batch-invariant on its own; two paths round differently.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"
#include "ops.h"

#ifdef VLLM_CPU_X86
#define VLLM_LINEAR_X86 1
#endif

namespace linear_small_m_impl {

using vllm_cpu_isa::best_isa;
using vllm_cpu_isa::cpu_has;
using vllm_cpu_isa::Isa;
using vllm_cpu_isa::kAuto;
using vllm_cpu_isa::kAvx2;
using vllm_cpu_isa::kAvx512;
using vllm_cpu_isa::kAvx512Bf16;
using vllm_cpu_isa::kPortable;

constexpr int64_t kNR = 4;  // weight rows per block, read from memory once for all M rows

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// What a micro-kernel pulls into cache as it goes: `step` bytes from p per step over k (p null:
// nothing). The tiles of one weight block share the next block between them, so the memory
// stream keeps going while later tiles multiply out of L1.
struct Prefetch {
  const char* p = nullptr;
  int64_t step = 0;
};

// ---- portable ------------------------------------------------------------------------------
constexpr int64_t kLanes = 8;

template <int MR, int NR, typename TX, typename TW>
void micro_portable(const TX* x, int64_t ldx, const TW* w, int64_t ldw, int64_t K, Prefetch,
                    float* out) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float acc[kLanes] = {};
      const TX* xr = x + i * ldx;
      const TW* wr = w + j * ldw;
      int64_t k = 0;
      for (; k + kLanes <= K; k += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[l] += to_f(xr[k + l]) * to_f(wr[k + l]);
      for (int l = 0; k + l < K; ++l) acc[l] += to_f(xr[k + l]) * to_f(wr[k + l]);
      float s = 0.f;
      for (int l = 0; l < kLanes; ++l) s += acc[l];
      out[i * NR + j] = s;
    }
}

#ifdef VLLM_LINEAR_X86
// The SIMD micro-kernels share one body: MR x NR accumulators (named variables: GCC keeps an
// array of vector accumulators in memory, storing every one of them at every step), one loop
// over k whose last step is the zero-padded (masked) tail, then one horizontal sum each.
// ACC accumulator type, WV loaded-vector type, STEP elements per step, MASK(left) the step's
// mask, LOAD(ptr, mask), FMA(acc, x, w), HSUM(acc).
#define VLLM_MICRO_BODY(TW, ACC, WV, STEP, MASK, LOAD, FMA, HSUM, ZERO)                       \
  static_assert((MR >= 1 && MR <= 4) && (NR == 1 || NR == 4), "tile shape");                 \
  const ACC z = ZERO;                                                                         \
  ACC c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z;                 \
  ACC c20 = z, c21 = z, c22 = z, c23 = z, c30 = z, c31 = z, c32 = z, c33 = z;                 \
  for (int64_t k = 0; k < K; k += STEP) {                                                     \
    const auto m = MASK(K - k);                                                               \
    if (pf.p != nullptr) /* a share of the next block: one sequential stream */              \
      for (int64_t b = 0; b < pf.step; b += 64)                                               \
        _mm_prefetch(pf.p + (k / STEP) * pf.step + b, _MM_HINT_T0);                           \
    const WV w0 = LOAD(w + k, m);                                                             \
    WV w1 = w0, w2 = w0, w3 = w0;                                                             \
    if constexpr (NR > 1) {                                                                   \
      w1 = LOAD(w + ldw + k, m);                                                              \
      w2 = LOAD(w + 2 * ldw + k, m);                                                          \
      w3 = LOAD(w + 3 * ldw + k, m);                                                          \
    }                                                                                         \
    VLLM_MICRO_ROW(0, LOAD, FMA)                                                              \
    if constexpr (MR > 1) VLLM_MICRO_ROW(1, LOAD, FMA)                                        \
    if constexpr (MR > 2) VLLM_MICRO_ROW(2, LOAD, FMA)                                        \
    if constexpr (MR > 3) VLLM_MICRO_ROW(3, LOAD, FMA)                                        \
  }                                                                                           \
  const ACC c[4][4] = {                                                                       \
      {c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23}, {c30, c31, c32, c33}}; \
  for (int i = 0; i < MR; ++i)                                                                \
    for (int j = 0; j < NR; ++j) out[i * NR + j] = HSUM(c[i][j]);

#define VLLM_MICRO_ROW(I, LOAD, FMA)                \
  {                                                 \
    const auto xv = LOAD(x + (I) * ldx + k, m);     \
    c##I##0 = FMA(c##I##0, xv, w0);                 \
    if constexpr (NR > 1) {                         \
      c##I##1 = FMA(c##I##1, xv, w1);               \
      c##I##2 = FMA(c##I##2, xv, w2);               \
      c##I##3 = FMA(c##I##3, xv, w3);               \
    }                                               \
  }

// ---- AVX2 + FMA: 8 fp32 lanes --------------------------------------------------------------
#define VLLM_AVX2 __attribute__((target("avx2,fma")))

VLLM_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
VLLM_AVX2 inline __m256 load8(const c10::BFloat16* p) {  // bf16 is fp32's top half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <typename T>
VLLM_AVX2 inline __m256 load8(const T* p, int64_t left) {  // left < 8: zero-padded copy
  if (left >= 8) return load8(p);
  T buf[8] = {};
  std::memcpy(buf, p, sizeof(T) * left);
  return load8(buf);
}
VLLM_AVX2 inline int64_t mask8(int64_t left) { return left; }
VLLM_AVX2 inline __m256 fma8(__m256 acc, __m256 x, __m256 w) { return _mm256_fmadd_ps(x, w, acc); }
VLLM_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

template <int MR, int NR, typename TX, typename TW>
VLLM_AVX2 void micro_avx2(const TX* x, int64_t ldx, const TW* w, int64_t ldw, int64_t K,
                          Prefetch pf, float* out) {
  VLLM_MICRO_BODY(TW, __m256, __m256, 8, mask8, load8, fma8, hsum8, _mm256_setzero_ps())
}

// ---- AVX512F (+BW, VL): 16 fp32 lanes ------------------------------------------------------
#define VLLM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

VLLM_AVX512 inline __mmask16 mask16(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}
VLLM_AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
VLLM_AVX512 inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
VLLM_AVX512 inline __m512 fma16(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
VLLM_AVX512 inline float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

template <int MR, int NR, typename TX, typename TW>
VLLM_AVX512 void micro_avx512(const TX* x, int64_t ldx, const TW* w, int64_t ldw, int64_t K,
                              Prefetch pf, float* out) {
  VLLM_MICRO_BODY(TW, __m512, __m512, 16, mask16, load16, fma16, hsum16, _mm512_setzero_ps())
}

// ---- AVX512-BF16: vdpbf16ps over bf16 pairs (32 per step) ----------------------------------
#define VLLM_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

VLLM_AVX512BF16 inline __mmask32 mask32(int64_t left) {
  return left >= 32 ? __mmask32(0xFFFFFFFFu) : static_cast<__mmask32>((uint64_t{1} << left) - 1u);
}
VLLM_AVX512BF16 inline __m512bh load32bh(const c10::BFloat16* p, __mmask32 m) {
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}
VLLM_AVX512BF16 inline __m512 dot32(__m512 acc, __m512bh x, __m512bh w) {
  return _mm512_dpbf16_ps(acc, x, w);
}
VLLM_AVX512BF16 inline float hsum16bh(__m512 v) { return _mm512_reduce_add_ps(v); }

template <int MR, int NR>
VLLM_AVX512BF16 void micro_avx512bf16(const c10::BFloat16* x, int64_t ldx,
                                      const c10::BFloat16* w, int64_t ldw, int64_t K,
                                      Prefetch pf, float* out) {
  VLLM_MICRO_BODY(c10::BFloat16, __m512, __m512bh, 32, mask32, load32bh, dot32, hsum16bh,
                  _mm512_setzero_ps())
}
#endif  // VLLM_LINEAR_X86

// One micro-kernel call: out[i * NR + j] = dot(x row i, w row j), i < MR, j < NR. x is T, or
// fp32 widened from bf16 once per call for the paths that multiply in fp32.
template <Isa ISA, int MR, int NR, typename TX, typename TW>
inline void micro(const TX* x, int64_t ldx, const TW* w, int64_t ldw, int64_t K, Prefetch pf,
                  float* out) {
#ifdef VLLM_LINEAR_X86
  if constexpr (ISA == kAvx512Bf16 && std::is_same_v<TW, c10::BFloat16>) {
    static_assert(std::is_same_v<TX, c10::BFloat16>);
    micro_avx512bf16<MR, NR>(x, ldx, w, ldw, K, pf, out);
  } else if constexpr (ISA == kAvx512Bf16 || ISA == kAvx512) {
    micro_avx512<MR, NR>(x, ldx, w, ldw, K, pf, out);
  } else if constexpr (ISA == kAvx2) {
    micro_avx2<MR, NR>(x, ldx, w, ldw, K, pf, out);
  } else {
    micro_portable<MR, NR>(x, ldx, w, ldw, K, pf, out);
  }
#else
  micro_portable<MR, NR>(x, ldx, w, ldw, K, pf, out);
#endif
}

// Rows of x per tile: as many accumulators as the registers hold next to kNR weight vectors.
template <Isa ISA>
constexpr int kMR = (ISA == kAvx512 || ISA == kAvx512Bf16) ? 4 : 2;

template <Isa ISA, int NR, typename TX, typename T>
inline void tile(int64_t mr, const TX* x, int64_t ldx, const T* w, int64_t ldw, int64_t K,
                 Prefetch pf, float* out) {
  static_assert(kMR<ISA> == 2 || kMR<ISA> == 4);
  switch (mr) {
    case 1:
      return micro<ISA, 1, NR>(x, ldx, w, ldw, K, pf, out);
    case 2:
      return micro<ISA, 2, NR>(x, ldx, w, ldw, K, pf, out);
    case 3:
      if constexpr (kMR<ISA> >= 3) return micro<ISA, 3, NR>(x, ldx, w, ldw, K, pf, out);
      break;
    case 4:
      if constexpr (kMR<ISA> >= 4) return micro<ISA, 4, NR>(x, ldx, w, ldw, K, pf, out);
      break;
  }
}

// Output columns [n0, n1) of all M rows.
template <Isa ISA, typename TX, typename T>
void run_columns(const TX* xp, int64_t ldx, int64_t M, const T* wp, int64_t ldw, int64_t K,
                 const T* bp, T* yp, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int MR = kMR<ISA>;
  constexpr int64_t kStep = ISA == kAvx512Bf16 && !std::is_same_v<TX, float> ? 32
                            : ISA == kAvx512 || ISA == kAvx512Bf16          ? 16
                                                                            : 8;
  const int64_t tiles = (M + MR - 1) / MR, steps = std::max<int64_t>(1, (K + kStep - 1) / kStep);
  const int64_t block_bytes = kNR * K * static_cast<int64_t>(sizeof(T));
  float acc[MR * kNR];
  for (int64_t n = n0; n < n1; n += kNR) {
    const int64_t nr = std::min(kNR, n1 - n);
    for (int64_t m = 0; m < M; m += MR) {
      const int64_t mr = std::min<int64_t>(MR, M - m);
      const TX* x = xp + m * ldx;
      if (nr == kNR) {
        // The tiles pull the next block (contiguous rows) in as one sequential stream, each a
        // share of it, while this one is multiplied: kNR interleaved row streams alone reach
        // about half the bandwidth of one sequential read.
        Prefetch pf;
        if (ldw == K && n + 2 * kNR <= n1) {
          const int64_t tile_no = m / MR, share = (block_bytes + tiles - 1) / tiles;
          pf.p = reinterpret_cast<const char*>(wp + (n + kNR) * ldw) + tile_no * share;
          pf.step = ((share + steps - 1) / steps + 63) / 64 * 64;
        }
        tile<ISA, kNR>(mr, x, ldx, wp + n * ldw, ldw, K, pf, acc);
      } else {
        for (int64_t j = 0; j < nr; ++j) {  // the last rows of N: one at a time
          float one[MR];
          tile<ISA, 1>(mr, x, ldx, wp + (n + j) * ldw, ldw, K, Prefetch{}, one);
          for (int64_t i = 0; i < mr; ++i) acc[i * kNR + j] = one[i];
        }
      }
      for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < nr; ++j) {
          float v = acc[i * kNR + j];
          if (bp) v += to_f(bp[n + j]);
          yp[(m + i) * ldy + n + j] = static_cast<T>(v);
        }
    }
  }
}

template <typename TX, typename T>
void run_isa(Isa isa, const TX* xp, int64_t ldx, int64_t M, const T* wp, int64_t ldw, int64_t K,
             int64_t N, const T* bp, T* yp, int64_t ldy) {
  const int64_t blocks = (N + kNR - 1) / kNR;
  // Split over threads only when each gets a sizeable share of the weight (about 1 MB): a
  // parallel region costs more than a small layer's whole product when the other cores are
  // busy. The split never changes a result (each output element is computed whole by one
  // thread, the same way).
  const int64_t bytes_per_block = kNR * K * static_cast<int64_t>(sizeof(T));
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(bytes_per_block, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kNR, n1 = std::min(N, b1 * kNR);
    switch (isa) {
      case kAvx512Bf16:
        if constexpr (std::is_same_v<TX, T>)
          return run_columns<kAvx512Bf16>(xp, ldx, M, wp, ldw, K, bp, yp, ldy, n0, n1);
        [[fallthrough]];  // fp32 inputs: the avx512 path
      case kAvx512:
        return run_columns<kAvx512>(xp, ldx, M, wp, ldw, K, bp, yp, ldy, n0, n1);
      case kAvx2:
        return run_columns<kAvx2>(xp, ldx, M, wp, ldw, K, bp, yp, ldy, n0, n1);
      default:
        return run_columns<kPortable>(xp, ldx, M, wp, ldw, K, bp, yp, ldy, n0, n1);
    }
  });
}

template <typename T>
void run_linear(Isa isa, const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias,
                at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t ldx = x.stride(0), ldw = w.stride(0), ldy = y.stride(0);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  const T* bp = bias ? bias->const_data_ptr<T>() : nullptr;
  T* yp = y.mutable_data_ptr<T>();
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (isa != kAvx512Bf16) {
      // The paths that multiply in fp32 widen the (few KB of) input rows once, not once per
      // weight block; widening is exact, so the result is the same as widening in registers.
      std::vector<float> xf(static_cast<size_t>(M * K));
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) xf[m * K + k] = static_cast<float>(xp[m * ldx + k]);
      return run_isa<float, T>(isa, xf.data(), K, M, wp, ldw, K, N, bp, yp, ldy);
    }
  }
  run_isa<T, T>(isa, xp, ldx, M, wp, ldw, K, N, bp, yp, ldy);
}

}  // namespace linear_small_m_impl

int64_t linear_small_m_isa(int64_t requested) {
  using namespace linear_small_m_impl;
  if (requested == kAuto) return best_isa();
  TORCH_CHECK(requested >= kPortable && requested <= kAvx512Bf16,
              "linear_small_m: unknown instruction-set path ", requested);
  TORCH_CHECK(cpu_has(static_cast<Isa>(requested)),
              "linear_small_m: this CPU cannot run instruction-set path ", requested);
  return requested;
}

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias, int64_t isa) {
  using namespace linear_small_m_impl;
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear_small_m: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear_small_m: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "linear_small_m: x and weight dtypes");
  TORCH_CHECK(x.stride(1) == 1 && weight.stride(1) == 1, "linear_small_m: contiguous rows");
  const at::Tensor* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "linear_small_m: bias [N] of x's dtype");
    b = &bias.value();
  }
  const Isa path = static_cast<Isa>(linear_small_m_isa(isa));
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.size(0) == 0 || weight.size(0) == 0) return y;
  switch (x.scalar_type()) {
    case at::kFloat:
      run_linear<float>(path, x, weight, b, y);
      break;
    case at::kBFloat16:
      run_linear<c10::BFloat16>(path, x, weight, b, y);
      break;
    default:
      TORCH_CHECK(false, "linear_small_m: unsupported dtype ", x.scalar_type());
  }
  return y;
}
