// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors
//
// Rotary position embedding of q and k in one call (the torch path takes ~20 ops per layer):
// neox style (rotate the two halves) or GPT-J style (rotate interleaved pairs) over the first
// rotary_dim channels of every head, the rest copied. fp32 arithmetic without FMA contraction,
// rounded to the input dtype once, as the torch module does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <tuple>

#include "elem.h"
#include "ops.h"

namespace {

// x is read as [tokens, heads, head_size] with strides (token_stride, head_stride, 1); out is
// written contiguous.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate(
    T* out_t, const T* x_t, int64_t tokens, int64_t heads, int64_t head_size,
    int64_t token_stride, int64_t head_stride, int64_t rot, const float* cos, const float* sin,
    const int64_t* pos, int64_t cache_stride, bool neox) {
  using E = vllm_cpu::Elem<T>;  // bf16 as its bits: conversions that vectorize (elem.h)
  using S = typename E::S;
  S* out = reinterpret_cast<S*>(out_t);
  const S* x = reinterpret_cast<const S*>(x_t);
  const int64_t half = rot / 2;
  // Chunks of at least ~32K elements (see layernorm.cpp).
  const int64_t grain = std::max<int64_t>(16, 32768 / std::max<int64_t>(heads * head_size, 1));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * cache_stride;
      const float* s = sin + pos[t] * cache_stride;
      for (int64_t h = 0; h < heads; ++h) {
        const S* xr = x + t * token_stride + h * head_stride;
        S* o = out + (t * heads + h) * head_size;
        if (neox) {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = E::load(xr[i]), x2 = E::load(xr[i + half]);
            o[i] = E::store(x1 * c[i] - x2 * s[i]);
            o[i + half] = E::store(x2 * c[i] + x1 * s[i]);
          }
        } else {
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = E::load(xr[2 * i]), x2 = E::load(xr[2 * i + 1]);
            o[2 * i] = E::store(x1 * c[i] - x2 * s[i]);
            o[2 * i + 1] = E::store(x2 * c[i] + x1 * s[i]);
          }
        }
        for (int64_t i = rot; i < head_size; ++i) o[i] = xr[i];
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions,
                                                    const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& cos_cache,
                                                    const at::Tensor& sin_cache,
                                                    int64_t head_size, int64_t rotary_dim,
                                                    bool is_neox) {
  TORCH_CHECK(q.device().is_cpu() && positions.is_contiguous() &&
                  positions.scalar_type() == at::kLong,
              "rotary_embedding: CPU q/k and contiguous int64 positions");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary_embedding: q and k dtypes differ");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
                  cos_cache.is_contiguous() && sin_cache.is_contiguous() &&
                  cos_cache.dim() == 2 && cos_cache.size(1) == rotary_dim / 2 &&
                  sin_cache.sizes() == cos_cache.sizes(),
              "rotary_embedding: fp32 cos/sin caches [max_position, rotary_dim / 2]");
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_size && head_size > 0,
              "rotary_embedding: bad rotary_dim / head_size");
  const int64_t tokens = positions.numel();
  if (tokens == 0) return {at::empty_like(q), at::empty_like(k)};
  // [T, heads * head_size] or [T, heads, head_size], each head's channels contiguous.
  auto layout = [&](const at::Tensor& x) {
    TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.size(0) == tokens && x.stride(-1) == 1 &&
                    (x.dim() == 3 ? x.size(2) == head_size : x.size(1) % head_size == 0),
                "rotary_embedding: q/k must be [tokens, heads * head_size] or "
                "[tokens, heads, head_size] with contiguous heads");
    const int64_t heads = x.dim() == 3 ? x.size(1) : x.size(1) / head_size;
    const int64_t head_stride = x.dim() == 3 ? x.stride(1) : head_size;
    return std::tuple<int64_t, int64_t, int64_t>{heads, x.stride(0), head_stride};
  };
  const auto q_layout = layout(q), k_layout = layout(k);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t max_pos = cos_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_embedding: position ", pos[t],
                " outside the cache of ", max_pos);
  auto contiguous_like = [](const at::Tensor& x) {
    return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  };
  at::Tensor q_out = contiguous_like(q), k_out = contiguous_like(k);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    for (auto [src, dst, lay] : {std::tuple{&q, &q_out, q_layout}, std::tuple{&k, &k_out, k_layout}})
      rotate<T>(dst->template data_ptr<T>(), src->template const_data_ptr<T>(), tokens,
                std::get<0>(lay), head_size, std::get<1>(lay), std::get<2>(lay), rotary_dim,
                cos_cache.const_data_ptr<float>(), sin_cache.const_data_ptr<float>(), pos,
                cos_cache.size(1), is_neox);
  };
  switch (q.scalar_type()) {
    case at::kFloat:
      run(float{});
      break;
    case at::kBFloat16:
      run(c10::BFloat16{});
      break;
    case at::kHalf:
      run(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, "rotary_embedding: unsupported dtype ", q.scalar_type());
  }
  return {q_out, k_out};
}
