// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors
//
// Rotary position embedding of q and k in one call (the torch path takes ~20 ops per layer):
// neox style (rotate the two halves) or GPT-J style (rotate interleaved pairs) over the first
// rotary_dim channels of every head, the rest copied. fp32 arithmetic without FMA contraction,
// rounded to the input dtype once, as the torch module does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <tuple>

#include "ops.h"

namespace {

template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate(
    T* out, const T* x, int64_t tokens, int64_t heads, int64_t head_size, int64_t rot,
    const float* cos, const float* sin, const int64_t* pos, int64_t cache_stride, bool neox) {
  const int64_t half = rot / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * cache_stride;
      const float* s = sin + pos[t] * cache_stride;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + (t * heads + h) * head_size;
        T* o = out + (t * heads + h) * head_size;
        if (neox) {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(xr[i]), x2 = static_cast<float>(xr[i + half]);
            o[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
            o[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
          }
        } else {
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(xr[2 * i]), x2 = static_cast<float>(xr[2 * i + 1]);
            o[2 * i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
            o[2 * i + 1] = static_cast<T>(x2 * c[i] + x1 * s[i]);
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
  TORCH_CHECK(q.device().is_cpu() && q.is_contiguous() && k.is_contiguous() &&
                  positions.is_contiguous() && positions.scalar_type() == at::kLong,
              "rotary_embedding: contiguous CPU q/k and int64 positions");
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
  TORCH_CHECK(q.numel() % (tokens * head_size) == 0 && k.numel() % (tokens * head_size) == 0,
              "rotary_embedding: q/k are not [tokens, heads * head_size]");
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t max_pos = cos_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_embedding: position ", pos[t],
                " outside the cache of ", max_pos);
  at::Tensor q_out = at::empty_like(q), k_out = at::empty_like(k);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    for (auto [src, dst] : {std::pair{&q, &q_out}, std::pair{&k, &k_out}})
      rotate<T>(dst->template data_ptr<T>(), src->template const_data_ptr<T>(), tokens,
                src->numel() / (tokens * head_size), head_size, rotary_dim,
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
