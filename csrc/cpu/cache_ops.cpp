// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors
//
// Small per-layer steps of a decode / verify / draft forward done in one call each instead of
// several torch ops from Python (at one to a few dozen rows, the ops' dispatch costs far more
// than their work):
//   write_kv      the new keys and values of a step into their slots of the paged cache
//                 (what `cache[0][slots] = k; cache[1][slots] = v` does), a plain copy;
//   silu_and_mul  silu(x[:, :d]) * x[:, d:], by ATen's own silu and multiply (bit for bit the
//                 torch path's result: the same kernels, called without Python in between).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "ops.h"

void write_kv(at::Tensor kv_cache, const at::Tensor& slot_mapping, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "write_kv: kv_cache must be a contiguous [2, slots, kv_heads, head_size] tensor");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong,
              "write_kv: slot_mapping must be a 1-D int64 tensor");
  const int64_t T = slot_mapping.size(0);
  const int64_t S = kv_cache.size(1);
  const int64_t row = kv_cache.size(2) * kv_cache.size(3);  // elements of one slot
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->scalar_type() == kv_cache.scalar_type(),
                "write_kv: keys / values must have the cache's dtype");
    TORCH_CHECK(t->dim() == 3 && t->size(0) >= T && t->size(1) == kv_cache.size(2) &&
                    t->size(2) == kv_cache.size(3),
                "write_kv: keys / values must be [tokens, kv_heads, head_size] like the cache");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == kv_cache.size(3),
                "write_kv: each token's keys / values must be contiguous");
  }
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i) {
    TORCH_CHECK(sp[i] < S, "write_kv: slot ", sp[i], " is outside the cache's ", S, " slots");
  }
  const int64_t es = kv_cache.element_size();
  char* kc = static_cast<char*>(kv_cache.data_ptr());
  char* vc = kc + S * row * es;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * es, vs = v.stride(0) * es, n = row * es;
  // A negative slot is a padding token (not written), as in vLLM's cache writes.
  for (int64_t i = 0; i < T; ++i) {
    if (sp[i] < 0) continue;
    std::memcpy(kc + sp[i] * n, kp + i * ks, n);
    std::memcpy(vc + sp[i] * n, vp + i * vs, n);
  }
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: the last dimension must be even");
  const int64_t d = x.size(-1) / 2;
  at::Tensor out = at::silu(x.narrow(-1, 0, d));
  out.mul_(x.narrow(-1, d, d));
  return out;
}
