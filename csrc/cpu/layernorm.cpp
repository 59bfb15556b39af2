// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors
//
// RMSNorm, and RMSNorm of (x + residual) returning the sum too, in one pass per row instead of
// ~8 separate torch ops. Same arithmetic as the torch module: the sum is formed in the input
// dtype, the normalisation in fp32, and the result rounded to the dtype before the weight
// multiply (itself rounded), so bf16 outputs match the torch path bit for bit up to the order
// of the fp32 mean.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "elem.h"
#include "ops.h"

namespace {

// Rows of x are x_stride apart (a 2-D view with contiguous rows, e.g. a column slice); out,
// sum_out and res are contiguous.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void norm_rows(
    T* out_t, T* sum_out_t, const T* x_t, int64_t x_stride, const T* res_t, const T* w_t,
    int64_t rows, int64_t d, float eps) {
  using E = vllm_cpu::Elem<T>;
  using S = typename E::S;
  static_assert(sizeof(S) == sizeof(T));
  S* out = reinterpret_cast<S*>(out_t);
  S* sum_out = reinterpret_cast<S*>(sum_out_t);
  const S* x = reinterpret_cast<const S*>(x_t);
  const S* res = reinterpret_cast<const S*>(res_t);
  const S* w = reinterpret_cast<const S*>(w_t);
  // Chunks of at least ~32K elements (ATen's own grain for elementwise work): a parallel
  // region costs more than a few rows' worth of work, and far more when a core is busy.
  const int64_t grain = std::max<int64_t>(16, 32768 / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(d);
    for (int64_t r = begin; r < end; ++r) {
      const S* xr = x + r * x_stride;
      float ss = 0.f;
      if (res != nullptr) {
        const S* rr = res + r * d;
        S* sr = sum_out + r * d;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < d; ++i) {
          const S s = E::store(E::load(xr[i]) + E::load(rr[i]));
          sr[i] = s;
          buf[i] = E::load(s);
          ss += buf[i] * buf[i];
        }
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < d; ++i) {
          buf[i] = E::load(xr[i]);
          ss += buf[i] * buf[i];
        }
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
      S* o = out + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        const S normed = E::store(buf[i] * inv);
        o[i] = E::store(E::load(w[i]) * E::load(normed));
      }
    }
  });
}

// The row stride of x: contiguous, or 2-D with contiguous rows.
int64_t check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.is_contiguous() &&
                  (x.is_contiguous() || (x.dim() == 2 && x.stride(1) == 1)),
              "rms_norm: CPU x with contiguous rows");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: weight must match the last dimension");
  return x.is_contiguous() ? x.size(-1) : x.stride(0);
}

template <typename F>
void dispatch(const at::Tensor& x, F&& f) {
  switch (x.scalar_type()) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t x_stride = check(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(out.data_ptr<T>(), nullptr, x.const_data_ptr<T>(), x_stride, nullptr,
                 weight.const_data_ptr<T>(), rows, d, static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  const int64_t x_stride = check(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.is_contiguous(),
              "add_rms_norm: residual must match x");
  at::Tensor out = at::empty(x.sizes(), x.options()), sum = at::empty(x.sizes(), x.options());
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(out.data_ptr<T>(), sum.data_ptr<T>(), x.const_data_ptr<T>(), x_stride,
                 residual.const_data_ptr<T>(), weight.const_data_ptr<T>(), rows, d,
                 static_cast<float>(eps));
  });
  return {out, sum};
}
