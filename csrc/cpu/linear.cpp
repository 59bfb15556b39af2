// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors
//
// y = x @ W^T (+ b) for the few rows of a decode / verify / draft step (small M), W [N, K] and
// x [M, K] both fp32, both bf16, or fp32 x with bf16 W (exact: bf16 widens to fp32 without
// rounding), accumulated in fp32, rounded to x's dtype once.
//
// With M this small the product is bound by streaming W from memory at one row and by the FMA
// units from a few rows on: a block of weight rows is read from memory once and multiplied
// against every row of x while it sits in L1, in register tiles (MR rows of x by NR weight rows
// of vector accumulators, sized to the register file as llamafile's tinyBLAS does) so that each
// weight vector loaded feeds MR rows and each x vector NR weight rows.
//
// Batch invariance by construction: output element (m, n) is always one vector accumulator
// running over k in the same order (whole vectors, then the zero-padded tail), then the same
// horizontal sum, then + bias and one rounding - whatever M is, whichever rows share the call,
// whichever tile shape runs (picked from M) and however the output columns are split across
// threads. Tiles only change how many independent accumulators are live at once, never the
// arithmetic of any one of them.
//
// The instruction set is chosen at run time (cpuid), each path compiled with its own target
// attribute, so one build runs on AVX2-only and AVX512-BF16 machines alike:
//   4 avx512bf16: bf16 pairs with vdpbf16ps (fp32 weights: the avx512 path)
//   3 avx512:     AVX512F(+BW, VL) FMA over 16 fp32 lanes (bf16 widened in registers)
//   2 avx2:       AVX2 + FMA over 8 fp32 lanes
//   1 portable:   plain C++ over 8 fp32 partial sums
// Each path is batch-invariant on its own; two paths round differently.

#include <cmath>
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

// Register tiles: MR rows of x by NR rows of W, MR * NR vector accumulators live at once, so each
// weight vector loaded is multiplied by MR rows and each x vector by NR weight rows. A block of
// NR weight rows is read from memory once and stays in L1 while every tile of MR rows of x
// passes over it. Which tile shape runs (picked from M and the instruction set) changes how
// many accumulators are live, never the arithmetic of any one of them.

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// What a micro-kernel pulls into cache as it goes: `step` bytes from p per step over k (p null:
// nothing). The tiles of one weight block share the block kPrefetchBlocks ahead between them,
// so the memory stream keeps going while later tiles multiply out of L1. Into L2 (T1), not L1:
// on the AVX512-BF16 EPYC, T1 two blocks ahead streams M = 1 at 22 GB/s (a plain sum's rate)
// where T0 one block ahead reached 16, and M = 8 fp32 went from 51 to 30 ms over SmolLM2's
// weights (benchmarks/RESULTS.md, Run 12): L1 prefetches of a whole block left the tiles'
// own loads waiting behind them.
constexpr int64_t kPrefetchBlocks = 2;
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
      // std::fma, not a * b + c: whether the compiler contracts the latter into an FMA can
      // differ between the fp32 and the bf16 instantiation (it did under -march=native on an
      // AVX512-BF16 CPU), and a bf16 weight must give its exact fp32 widening's product.
      for (; k + kLanes <= K; k += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(to_f(xr[k + l]), to_f(wr[k + l]), acc[l]);
      for (int l = 0; k + l < K; ++l) acc[l] = std::fma(to_f(xr[k + l]), to_f(wr[k + l]), acc[l]);
      float s = 0.f;
      for (int l = 0; l < kLanes; ++l) s += acc[l];
      out[i * NR + j] = s;
    }
}

#ifdef VLLM_LINEAR_X86
// The SIMD micro-kernels share one body: up to 4 x 8 accumulators (named variables: GCC keeps
// an array of vector accumulators in memory, storing every one of them at every step; the
// unused ones are dead code), a loop over whole vectors of k with plain loads, then at most one
// zero-padded (masked) tail step into the same accumulators, then one horizontal sum each.
// ACC accumulator type, WV loaded-vector type, STEP elements per step, MASK(left) the tail's
// mask, LOAD(ptr, Full{} or mask), FMA(acc, x, w), HSUM(acc).
struct Full {};  // a whole vector: a plain load

#define VLLM_ACC_ROW(I)                                                                      \
  Acc a##I##_0 = z, a##I##_1 = z, a##I##_2 = z, a##I##_3 = z, a##I##_4 = z, a##I##_5 = z,          \
      a##I##_6 = z, a##I##_7 = z;

// Each weight (and x) vector is loaded once per step into a register: without the (empty) asm, GCC
// folds the load into every FMA that reads it as a memory operand - MR loads of the same
// vector instead of one, which made the 4 x 6 AVX512 tile load-bound (28 loads per 24 FMAs).
#define VLLM_PIN(V) asm("" : "+v"(V));
#define VLLM_IN_REG(J, V) \
  if constexpr (NR > (J) && MR > 1) VLLM_PIN(V)

#define VLLM_FMA_ROW(I, LOAD, M, FMA)                                                        \
  if constexpr (MR > (I)) {                                                                  \
    auto xv = LOAD(x + (I) * ldx + k, M);                                                    \
    if constexpr (NR > 1) VLLM_PIN(xv)                                                       \
    a##I##_0 = FMA(a##I##_0, xv, w0);                                                          \
    if constexpr (NR > 1) a##I##_1 = FMA(a##I##_1, xv, w1);                                    \
    if constexpr (NR > 2) a##I##_2 = FMA(a##I##_2, xv, w2);                                    \
    if constexpr (NR > 3) a##I##_3 = FMA(a##I##_3, xv, w3);                                    \
    if constexpr (NR > 4) a##I##_4 = FMA(a##I##_4, xv, w4);                                    \
    if constexpr (NR > 5) a##I##_5 = FMA(a##I##_5, xv, w5);                                    \
    if constexpr (NR > 6) a##I##_6 = FMA(a##I##_6, xv, w6);                                    \
    if constexpr (NR > 7) a##I##_7 = FMA(a##I##_7, xv, w7);                                    \
  }

#define VLLM_STEP(LOAD, M, FMA)                                                              \
  {                                                                                          \
    Wv w0 = LOAD(w + k, M);                                                                  \
    Wv w1 = w0, w2 = w0, w3 = w0, w4 = w0, w5 = w0, w6 = w0, w7 = w0;                        \
    if constexpr (NR > 1) w1 = LOAD(w + 1 * ldw + k, M);                                     \
    if constexpr (NR > 2) w2 = LOAD(w + 2 * ldw + k, M);                                     \
    if constexpr (NR > 3) w3 = LOAD(w + 3 * ldw + k, M);                                     \
    if constexpr (NR > 4) w4 = LOAD(w + 4 * ldw + k, M);                                     \
    if constexpr (NR > 5) w5 = LOAD(w + 5 * ldw + k, M);                                     \
    if constexpr (NR > 6) w6 = LOAD(w + 6 * ldw + k, M);                                     \
    if constexpr (NR > 7) w7 = LOAD(w + 7 * ldw + k, M);                                     \
    VLLM_IN_REG(0, w0) VLLM_IN_REG(1, w1) VLLM_IN_REG(2, w2) VLLM_IN_REG(3, w3)              \
    VLLM_IN_REG(4, w4) VLLM_IN_REG(5, w5) VLLM_IN_REG(6, w6) VLLM_IN_REG(7, w7)              \
    VLLM_FMA_ROW(0, LOAD, M, FMA)                                                            \
    VLLM_FMA_ROW(1, LOAD, M, FMA)                                                            \
    VLLM_FMA_ROW(2, LOAD, M, FMA)                                                            \
    VLLM_FMA_ROW(3, LOAD, M, FMA)                                                            \
  }

// The horizontal sums: HSUM::tile<MR, NR>(r, out) writes out[i * NR + j] = the sum of
// accumulator (i, j), r[i * 8 + j].
#define VLLM_OUT_TILE(HSUM)                                                                  \
  {                                                                                          \
    const Acc r[32] = {a0_0, a0_1, a0_2, a0_3, a0_4, a0_5, a0_6, a0_7,                        \
                       a1_0, a1_1, a1_2, a1_3, a1_4, a1_5, a1_6, a1_7,                        \
                       a2_0, a2_1, a2_2, a2_3, a2_4, a2_5, a2_6, a2_7,                        \
                       a3_0, a3_1, a3_2, a3_3, a3_4, a3_5, a3_6, a3_7};                       \
    HSUM::template tile<MR, NR>(r, out);                                                     \
  }

#define VLLM_MICRO_BODY(ACC, WV, STEP, MASK, LOAD, FMA, HSUM, ZERO)                          \
  static_assert(MR >= 1 && MR <= 4 && NR >= 1 && NR <= 8, "tile shape");                     \
  using Acc = ACC;                                                                           \
  using Wv = WV;                                                                             \
  const Acc z = ZERO;                                                                        \
  VLLM_ACC_ROW(0) VLLM_ACC_ROW(1) VLLM_ACC_ROW(2) VLLM_ACC_ROW(3)                            \
  const char* pfp = pf.p;                                                                    \
  int64_t k = 0;                                                                             \
  for (; k + (STEP) <= K; k += (STEP)) {                                                     \
    if (pfp != nullptr) { /* a share of the next block: one sequential stream */            \
      for (int64_t b = 0; b < pf.step; b += 64) _mm_prefetch(pfp + b, _MM_HINT_T1);          \
      pfp += pf.step;                                                                        \
    }                                                                                        \
    VLLM_STEP(LOAD, Full{}, FMA)                                                             \
  }                                                                                          \
  if (k < K) {                                                                               \
    const auto tail = MASK(K - k);                                                           \
    VLLM_STEP(LOAD, tail, FMA)                                                               \
  }                                                                                          \
  VLLM_OUT_TILE(HSUM)

// ---- AVX2 + FMA: 8 fp32 lanes --------------------------------------------------------------
#define VLLM_AVX2 __attribute__((target("avx2,fma")))

VLLM_AVX2 inline __m256 load8(const float* p, Full) { return _mm256_loadu_ps(p); }
VLLM_AVX2 inline __m256 load8(const c10::BFloat16* p, Full) {  // bf16 is fp32's top half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <typename T>
VLLM_AVX2 inline __m256 load8(const T* p, int64_t left) {  // 0 < left < 8: zero-padded copy
  T buf[8] = {};
  std::memcpy(buf, p, sizeof(T) * left);
  return load8(buf, Full{});
}
VLLM_AVX2 inline int64_t mask8(int64_t left) { return left; }
VLLM_AVX2 inline __m256 fma8(__m256 acc, __m256 x, __m256 w) { return _mm256_fmadd_ps(x, w, acc); }
VLLM_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
struct Hsum8Tile {
  template <int MR, int NR>
  VLLM_AVX2 static void tile(const __m256* r, float* out) {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) out[i * NR + j] = hsum8(r[i * 8 + j]);
  }
};

// A bf16 row widened to fp32 (exact), 8 at a time.
VLLM_AVX2 inline void widen_avx2(const c10::BFloat16* src, float* dst, int64_t K) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, load8(src + k, Full{}));
  for (; k < K; ++k) dst[k] = static_cast<float>(src[k]);
}

template <int MR, int NR, typename TX, typename TW>
VLLM_AVX2 void micro_avx2(const TX* x, int64_t ldx, const TW* w, int64_t ldw, int64_t K,
                          Prefetch pf, float* out) {
  VLLM_MICRO_BODY(__m256, __m256, 8, mask8, load8, fma8, Hsum8Tile, _mm256_setzero_ps())
}

// ---- AVX512F (+BW, VL): 16 fp32 lanes ------------------------------------------------------
#define VLLM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

VLLM_AVX512 inline __mmask16 mask16(int64_t left) {
  return static_cast<__mmask16>((1u << left) - 1u);  // 0 < left < 16
}
VLLM_AVX512 inline __m512 load16(const float* p, Full) { return _mm512_loadu_ps(p); }
VLLM_AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
VLLM_AVX512 inline __m512 widen16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
VLLM_AVX512 inline __m512 load16(const c10::BFloat16* p, Full) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
VLLM_AVX512 inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  return widen16(_mm256_maskz_loadu_epi16(m, p));
}
VLLM_AVX512 inline __m512 fma16(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }

// The horizontal sums of up to 16 accumulators at once, each by exactly _mm512_reduce_add_ps's
// pairing (lane i + lane i+8, then + 4, then + 2, then + 1; fp32 addition is commutative, so
// the results are bit for bit one reduce_add each) but transposed: every shuffle and add works
// on several accumulators' partial sums, 45 shuffles and adds for 16 sums instead of ~130.
// v[4k + c] holds accumulator 4c + k (a 4 x 4 transpose of the order), so lane j of the result
// is accumulator j's sum.
VLLM_AVX512 inline __m512 sums16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int p = 0; p < 8; ++p)  // s_i = a_i + a_{i+8}: two accumulators per vector
    x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
  for (int q = 0; q < 4; ++q)  // t_i = s_i + s_{i+4}: four per vector, one per 128-bit chunk
    y[q] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * q], x[2 * q + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * q], x[2 * q + 1], 0xDD));
  for (int r = 0; r < 2; ++r)  // u_i = t_i + t_{i+2}
    z[r] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * r], y[2 * r + 1], 0x44),
                         _mm512_shuffle_ps(y[2 * r], y[2 * r + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),  // u_0 + u_1
                       _mm512_shuffle_ps(z[0], z[1], 0xDD));
}

struct Hsum16Tile {
  // out[i * NR + j] = the sum of accumulator (i, j) (r[i * 8 + j]), 16 at a time.
  template <int MR, int NR>
  VLLM_AVX512 static void tile(const __m512* r, float* out) {
    constexpr int n = MR * NR;
    if constexpr (n < 4) {
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) out[i * NR + j] = _mm512_reduce_add_ps(r[i * 8 + j]);
    } else {
      for (int g = 0; g < n; g += 16) {
        __m512 v[16];
        for (int j = 0; j < 16; ++j) {
          const int a = g + 4 * (j % 4) + j / 4;  // v[4k + c] = accumulator g + 4c + k
          v[j] = a < n ? r[(a / NR) * 8 + a % NR] : _mm512_setzero_ps();
        }
        const __m512 s = sums16(v);
        const int left = n - g;
        if (left >= 16)
          _mm512_storeu_ps(out + g, s);
        else
          _mm512_mask_storeu_ps(out + g, static_cast<__mmask16>((1u << left) - 1u), s);
      }
    }
  }
};

template <int MR, int NR, typename TX, typename TW>
VLLM_AVX512 void micro_avx512(const TX* x, int64_t ldx, const TW* w, int64_t ldw, int64_t K,
                              Prefetch pf, float* out) {
  VLLM_MICRO_BODY(__m512, __m512, 16, mask16, load16, fma16, Hsum16Tile, _mm512_setzero_ps())
}

// ---- AVX512-BF16: vdpbf16ps over bf16 pairs (32 per step) ----------------------------------
#define VLLM_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

VLLM_AVX512BF16 inline __mmask32 mask32(int64_t left) {
  return static_cast<__mmask32>((uint64_t{1} << left) - 1u);  // 0 < left < 32
}
VLLM_AVX512BF16 inline __m512bh load32bh(const c10::BFloat16* p, Full) {
  return (__m512bh)_mm512_loadu_si512(p);
}
VLLM_AVX512BF16 inline __m512bh load32bh(const c10::BFloat16* p, __mmask32 m) {
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}
VLLM_AVX512BF16 inline __m512 dot32(__m512 acc, __m512bh x, __m512bh w) {
  return _mm512_dpbf16_ps(acc, x, w);
}

template <int MR, int NR>
VLLM_AVX512BF16 void micro_avx512bf16(const c10::BFloat16* x, int64_t ldx,
                                      const c10::BFloat16* w, int64_t ldw, int64_t K,
                                      Prefetch pf, float* out) {
  VLLM_MICRO_BODY(__m512, __m512bh, 32, mask32, load32bh, dot32, Hsum16Tile, _mm512_setzero_ps())
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

// The tile shapes, sized to the register file (16 ymm on AVX2, 32 zmm on AVX512): one row of x
// takes 8 weight rows at a time (8 accumulators + the x vector; the weights go straight from
// memory into the FMAs); more rows take tiles of 4 rows of x by 3 weight rows on AVX2 (12
// accumulators + 3 weight vectors + 1 x vector) and by 6 on AVX512 (24 + 6 + 1), so every
// weight vector loaded feeds 4 rows and every x vector 3 or 6 weight rows.
struct Shape {
  int mr, nr;
};
template <Isa ISA>
constexpr Shape kOneRow{1, 8};
template <Isa ISA>
constexpr Shape kRows{4, (ISA == kAvx512 || ISA == kAvx512Bf16) ? 6 : (ISA == kAvx2 ? 3 : 4)};

template <Isa ISA, int MR, int NR, typename TX, typename T>
inline void tile(int64_t mr, const TX* x, int64_t ldx, const T* w, int64_t ldw, int64_t K,
                 Prefetch pf, float* out) {
  static_assert(MR >= 1 && MR <= 4);
  switch (mr) {
    case 1:
      return micro<ISA, 1, NR>(x, ldx, w, ldw, K, pf, out);
    case 2:
      if constexpr (MR >= 2) return micro<ISA, 2, NR>(x, ldx, w, ldw, K, pf, out);
      break;
    case 3:
      if constexpr (MR >= 3) return micro<ISA, 3, NR>(x, ldx, w, ldw, K, pf, out);
      break;
    case 4:
      if constexpr (MR >= 4) return micro<ISA, 4, NR>(x, ldx, w, ldw, K, pf, out);
      break;
  }
}

template <Isa ISA, typename T>
inline void widen(const T* src, float* dst, int64_t K) {
#ifdef VLLM_LINEAR_X86
  if constexpr (ISA != kPortable && std::is_same_v<T, c10::BFloat16>)  // AVX512 CPUs have AVX2
    return widen_avx2(src, dst, K);
#endif
  for (int64_t k = 0; k < K; ++k) dst[k] = to_f(src[k]);
}

// Output columns [n0, n1) of all M rows, in blocks of NR weight rows, tiles of MR rows of x.
template <Isa ISA, int MR, int NR, typename TX, typename T, typename TY>
void run_columns(const TX* xp, int64_t ldx, int64_t M, const T* wp, int64_t ldw, int64_t K,
                 const TY* bp, TY* yp, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int64_t kStep = ISA == kAvx512Bf16 && !std::is_same_v<TX, float> ? 32
                            : ISA == kAvx512 || ISA == kAvx512Bf16          ? 16
                                                                            : 8;
  const int64_t tiles = (M + MR - 1) / MR, steps = std::max<int64_t>(1, K / kStep);
  const int64_t block_bytes = NR * K * static_cast<int64_t>(sizeof(T));
  float acc[MR * NR];
  // bf16 weights multiplied in fp32 by more than two tiles: the block is widened into an fp32
  // copy (in L1) once, not once per tile in registers (with two tiles, M = 5..8, widening in
  // registers is 12-14% faster on an AVX2 core: the copy's stores and reloads cost more than
  // one more widening per weight vector).
  float* wide = nullptr;
  if constexpr (std::is_same_v<TX, float> && !std::is_same_v<T, float>) {
    thread_local std::vector<float> buf;
    if (tiles > 2) {
      buf.resize(static_cast<size_t>(NR * K));
      wide = buf.data();
    }
  }
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t nr = std::min<int64_t>(NR, n1 - n);
    for (int64_t m = 0; m < M; m += MR) {
      const int64_t mr = std::min<int64_t>(MR, M - m);
      const TX* x = xp + m * ldx;
      if (nr == NR) {
        // The tiles pull the next block (contiguous rows) in as one sequential stream, each a
        // share of it, while this one is multiplied: NR interleaved row streams alone reach
        // about half the bandwidth of one sequential read.
        Prefetch pf;
        if (ldw == K && n + (kPrefetchBlocks + 1) * NR <= n1) {
          const int64_t tile_no = m / MR, share = (block_bytes + tiles - 1) / tiles;
          pf.p = reinterpret_cast<const char*>(wp + (n + kPrefetchBlocks * NR) * ldw) +
                 tile_no * share;
          pf.step = ((share + steps - 1) / steps + 63) / 64 * 64;
        }
        if (wide != nullptr) {
          if (m == 0)  // widened once for all the tiles (exact: the same fp32 values)
            for (int64_t j = 0; j < NR; ++j) widen<ISA>(wp + (n + j) * ldw, wide + j * K, K);
          tile<ISA, MR, NR>(mr, x, ldx, wide, K, K, pf, acc);
        } else {
          tile<ISA, MR, NR>(mr, x, ldx, wp + n * ldw, ldw, K, pf, acc);
        }
      } else {
        for (int64_t j = 0; j < nr; ++j) {  // the last rows of N: one at a time
          float one[MR];
          tile<ISA, MR, 1>(mr, x, ldx, wp + (n + j) * ldw, ldw, K, Prefetch{}, one);
          for (int64_t i = 0; i < mr; ++i) acc[i * NR + j] = one[i];
        }
      }
      for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < nr; ++j) {
          float v = acc[i * NR + j];
          if (bp) v += to_f(bp[n + j]);
          yp[(m + i) * ldy + n + j] = static_cast<TY>(v);
        }
    }
  }
}

template <Isa ISA, int MR, int NR, typename TX, typename T, typename TY>
void run_split(const TX* xp, int64_t ldx, int64_t M, const T* wp, int64_t ldw, int64_t K,
               int64_t N, const TY* bp, TY* yp, int64_t ldy) {
  const int64_t blocks = (N + NR - 1) / NR;
  // Split over threads only when each gets a sizeable share of the weight (about 1 MB): a
  // parallel region costs more than a small layer's whole product when the other cores are
  // busy. The split never changes a result (each output element is computed whole by one
  // thread, the same way).
  const int64_t bytes_per_block = NR * K * static_cast<int64_t>(sizeof(T));
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(bytes_per_block, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    run_columns<ISA, MR, NR>(xp, ldx, M, wp, ldw, K, bp, yp, ldy, b0 * NR, std::min(N, b1 * NR));
  });
}

template <Isa ISA, typename TX, typename T, typename TY>
void run_shape(const TX* xp, int64_t ldx, int64_t M, const T* wp, int64_t ldw, int64_t K,
               int64_t N, const TY* bp, TY* yp, int64_t ldy) {
  constexpr Shape one = kOneRow<ISA>, rows = kRows<ISA>;
  if (M == 1) return run_split<ISA, one.mr, one.nr>(xp, ldx, M, wp, ldw, K, N, bp, yp, ldy);
  run_split<ISA, rows.mr, rows.nr>(xp, ldx, M, wp, ldw, K, N, bp, yp, ldy);
}

template <typename TX, typename T, typename TY>
void run_isa(Isa isa, const TX* xp, int64_t ldx, int64_t M, const T* wp, int64_t ldw, int64_t K,
             int64_t N, const TY* bp, TY* yp, int64_t ldy) {
  switch (isa) {
    case kAvx512Bf16:
      if constexpr (std::is_same_v<TX, T>)
        return run_shape<kAvx512Bf16>(xp, ldx, M, wp, ldw, K, N, bp, yp, ldy);
      [[fallthrough]];  // fp32 inputs: the avx512 path
    case kAvx512:
      return run_shape<kAvx512>(xp, ldx, M, wp, ldw, K, N, bp, yp, ldy);
    case kAvx2:
      return run_shape<kAvx2>(xp, ldx, M, wp, ldw, K, N, bp, yp, ldy);
    default:
      return run_shape<kPortable>(xp, ldx, M, wp, ldw, K, N, bp, yp, ldy);
  }
}

// x, bias and y of type TX, W of type T: both fp32, both bf16, or fp32 x with bf16 W (a bf16
// checkpoint's weights kept in bf16 under an fp32 model: widened in registers or per block,
// exactly, so the result is the fp32 product with the widened weights, bit for bit).
template <typename TX, typename T>
void run_linear(Isa isa, const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias,
                at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t ldx = x.stride(0), ldw = w.stride(0), ldy = y.stride(0);
  const TX* xp = x.const_data_ptr<TX>();
  const T* wp = w.const_data_ptr<T>();
  const TX* bp = bias ? bias->const_data_ptr<TX>() : nullptr;
  TX* yp = y.mutable_data_ptr<TX>();
  if constexpr (std::is_same_v<TX, c10::BFloat16>) {
    if (isa != kAvx512Bf16) {
      // The paths that multiply in fp32 widen the (few KB of) input rows once per call - once
      // per activation, as the fused QKV / gate-up projections each take their input in one
      // call - not once per weight block or tile, into a buffer the calling thread keeps;
      // widening is exact, so the result is the same as widening in registers.
      thread_local std::vector<float> xf;
      xf.resize(static_cast<size_t>(M * K));
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) xf[m * K + k] = static_cast<float>(xp[m * ldx + k]);
      return run_isa<float, T, TX>(isa, xf.data(), K, M, wp, ldw, K, N, bp, yp, ldy);
    }
  }
  run_isa<TX, T, TX>(isa, xp, ldx, M, wp, ldw, K, N, bp, yp, ldy);
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
  const bool mixed = x.scalar_type() == at::kFloat && weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() || mixed,
              "linear_small_m: x and weight dtypes (the same, or fp32 x with bf16 weight)");
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
  if (mixed) {
    run_linear<float, c10::BFloat16>(path, x, weight, b, y);
    return y;
  }
  switch (x.scalar_type()) {
    case at::kFloat:
      run_linear<float, float>(path, x, weight, b, y);
      break;
    case at::kBFloat16:
      run_linear<c10::BFloat16, c10::BFloat16>(path, x, weight, b, y);
      break;
    default:
      TORCH_CHECK(false, "linear_small_m: unsupported dtype ", x.scalar_type());
  }
  return y;
}
