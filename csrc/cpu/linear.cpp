// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors
//
// y = x @ W^T (+ b) for the few rows of a decode step (small M), W [N, K] in fp32 or bf16.
//
// With M this small the product is bound by streaming W from memory once. The BLAS GEMM behind
// torch's linear reaches about two thirds of the machine's read bandwidth at M = 1 in fp32, and
// bf16 without AVX512-BF16 falls back to a generic loop that is slower still at M > 1. Here each
// block of 4 weight rows is read from memory once (bf16 rows widened to fp32 into an L1-sized
// buffer), then every pair of input rows is multiplied against it out of L1 with FMA
// accumulators in fp32; the result is rounded to the input dtype once, as torch's linear does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VLLM_CPU_LINEAR_AVX2 1
#endif

#include "ops.h"

namespace {

constexpr int64_t kRows = 4;  // weight rows per block (4 x 2 accumulators + loads fit 16 ymm)

#ifdef VLLM_CPU_LINEAR_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {  // widened in registers: bf16 is fp32's top half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

template <typename T>
inline void widen_rows(float* __restrict dst, const T* __restrict src, int64_t rows, int64_t k,
                       int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * ld;
    float* d = dst + r * k;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(d, s, sizeof(float) * k);
    } else {
      int64_t i = 0;
#ifdef VLLM_CPU_LINEAR_AVX2
      for (; i + 8 <= k; i += 8) _mm256_storeu_ps(d + i, load8(s + i));
#endif
      for (; i < k; ++i) d[i] = static_cast<float>(s[i]);
    }
  }
}

#ifdef VLLM_CPU_LINEAR_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

#ifdef VLLM_CPU_LINEAR_AVX2
// out[m * ldo + j] = dot(x[m], w[j * ldw]) for m < mrows (1 or 2) and the kRows weight rows;
// prefetch (may be null) is the next block of fp32 rows, pulled in at the pace this one is read.
template <typename T>
inline void dot_block_avx2(const float* __restrict x, int64_t ldx, int64_t mrows,
                           const T* __restrict w, int64_t ldw, int64_t k, float* out,
                           int64_t ldo, const float* prefetch) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
  __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  const float* x1 = x + (mrows > 1 ? ldx : 0);
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    if (prefetch != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + 4 * i), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + 4 * i + 16), _MM_HINT_T0);
    }
    const __m256 w0 = load8(w + i), w1 = load8(w + ldw + i);
    const __m256 w2 = load8(w + 2 * ldw + i), w3 = load8(w + 3 * ldw + i);
    const __m256 x0 = _mm256_loadu_ps(x + i), xb = _mm256_loadu_ps(x1 + i);
    a00 = _mm256_fmadd_ps(x0, w0, a00), a01 = _mm256_fmadd_ps(x0, w1, a01);
    a02 = _mm256_fmadd_ps(x0, w2, a02), a03 = _mm256_fmadd_ps(x0, w3, a03);
    a10 = _mm256_fmadd_ps(xb, w0, a10), a11 = _mm256_fmadd_ps(xb, w1, a11);
    a12 = _mm256_fmadd_ps(xb, w2, a12), a13 = _mm256_fmadd_ps(xb, w3, a13);
  }
  float r0[4] = {hsum(a00), hsum(a01), hsum(a02), hsum(a03)};
  float r1[4] = {hsum(a10), hsum(a11), hsum(a12), hsum(a13)};
  for (; i < k; ++i)
    for (int64_t j = 0; j < kRows; ++j) {
      const float wv = static_cast<float>(w[j * ldw + i]);
      r0[j] += x[i] * wv;
      r1[j] += x1[i] * wv;
    }
  for (int64_t j = 0; j < kRows; ++j) out[j] = r0[j];
  if (mrows > 1)
    for (int64_t j = 0; j < kRows; ++j) out[ldo + j] = r1[j];
}
#endif

// out[m * ldo + j] = dot(x[m], w[j]) for m < mrows (1 or 2), j < nrows (<= kRows), fp32.
inline void dot_block(const float* __restrict x, int64_t ldx, int64_t mrows,
                      const float* __restrict w, int64_t nrows, int64_t k, float* out,
                      int64_t ldo, const float* prefetch) {
#ifdef VLLM_CPU_LINEAR_AVX2
  if (nrows == kRows) return dot_block_avx2(x, ldx, mrows, w, k, k, out, ldo, prefetch);
#endif
  for (int64_t m = 0; m < mrows; ++m)
    for (int64_t j = 0; j < nrows; ++j) {
      float s = 0.f;
      for (int64_t i = 0; i < k; ++i) s += x[m * ldx + i] * w[j * k + i];
      out[m * ldo + j] = s;
    }
}

template <typename T>
void run_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias,
                at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t ldx = x.stride(0), ldw = w.stride(0), ldy = y.stride(0);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  const T* bp = bias ? bias->const_data_ptr<T>() : nullptr;
  T* yp = y.mutable_data_ptr<T>();
  // Inputs widened to fp32 once (they are a few KB).
  std::vector<float> xf(static_cast<size_t>(M * K));
  for (int64_t m = 0; m < M; ++m) widen_rows(&xf[m * K], xp + m * ldx, 1, K, K);
  const int64_t num_blocks = (N + kRows - 1) / kRows;
  // Split over threads only when each gets a sizeable share of the weight: a parallel region
  // costs more than a small layer's whole product when the other cores are busy.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(K * kRows, 1));
  at::parallel_for(0, num_blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> wbuf(static_cast<size_t>(kRows * K));
    float acc[2 * kRows];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRows, nr = std::min(kRows, N - n0);
#ifdef VLLM_CPU_LINEAR_AVX2
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (M <= 2 && nr == kRows) {  // widen in registers: the weights are read only once
          dot_block_avx2(xf.data(), K, M, wp + n0 * ldw, ldw, K, acc, kRows, nullptr);
          for (int64_t mm = 0; mm < M; ++mm)
            for (int64_t j = 0; j < nr; ++j) {
              float v = acc[mm * kRows + j];
              if (bp) v += static_cast<float>(bp[n0 + j]);
              yp[mm * ldy + n0 + j] = static_cast<T>(v);
            }
          continue;
        }
      }
#endif
      const float* wrow;
      if constexpr (std::is_same_v<T, float>) {
        if (ldw == K) {
          wrow = wp + n0 * K;  // contiguous rows: read in place
        } else {
          widen_rows(wbuf.data(), wp + n0 * ldw, nr, K, ldw);
          wrow = wbuf.data();
        }
      } else {
        widen_rows(wbuf.data(), wp + n0 * ldw, nr, K, ldw);
        wrow = wbuf.data();
      }
      for (int64_t m = 0; m < M; m += 2) {
        const int64_t mr = std::min<int64_t>(2, M - m);
        // fp32 rows read in place: pull the next block in while this one is multiplied.
        const float* next = (std::is_same_v<T, float> && ldw == K && m == 0 && n0 + 2 * kRows <= N)
                                ? reinterpret_cast<const float*>(wp) + (n0 + kRows) * K
                                : nullptr;
        dot_block(&xf[m * K], K, mr, wrow, nr, K, acc, kRows, next);
        for (int64_t mm = 0; mm < mr; ++mm)
          for (int64_t j = 0; j < nr; ++j) {
            float v = acc[mm * kRows + j];
            if (bp) v += static_cast<float>(bp[n0 + j]);
            yp[(m + mm) * ldy + n0 + j] = static_cast<T>(v);
          }
      }
    }
  });
}

}  // namespace

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias) {
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
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat:
      run_linear<float>(x, weight, b, y);
      break;
    case at::kBFloat16:
      run_linear<c10::BFloat16>(x, weight, b, y);
      break;
    default:
      TORCH_CHECK(false, "linear_small_m: unsupported dtype ", x.scalar_type());
  }
  return y;
}
