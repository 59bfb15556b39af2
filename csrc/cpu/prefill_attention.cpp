// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors
//
// Prefill / chunked-prefill attention on CPU, straight from the paged KV cache: no padded
// [R, S] gather and no mask tensor. Blocked over query tiles (the work items, spread over the
// threads costliest first) and key tiles (an online softmax in fp32 between the two products),
// the causal bound offset per request by its cached context, GQA / MQA (all query heads of a kv
// head share each key tile) and MLA's absorbed single-latent-head form (values a strided view
// of the keys), an optional sliding window. The decode / verify kernel (paged_attention.cpp)
// keeps the short queries; this one takes the long ones, whose query tiles make the two
// products compute-bound (register-blocked micro-kernels) instead of one dot product per key.
//
// The instruction set is picked at run time like the linear kernel's (cpu_isa.h): AVX512 (16
// lanes; also what AVX512-BF16 CPUs run here: bf16 inputs are widened to fp32 when a tile is
// gathered), AVX2 + FMA (8 lanes) or portable C++; `isa` forces one.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"
#include "ops.h"

namespace prefill_attention_impl {

constexpr float kPaNegInf = -std::numeric_limits<float>::infinity();

struct PrefillArgs {
  const void* q;
  int64_t qs0, qs1;
  const void* k;
  int64_t ks0, ks1;
  const void* v;
  int64_t vs0, vs1;
  void* out;
  int64_t os0, os1;
  int64_t G, Dk, Dv;
  const int64_t* bt;
  int64_t bt_stride;
  const int64_t* sl;
  const int64_t* qsl;
  int64_t block_size;
  float qscale;  // softmax scale * log2(e): the kernel works in base 2
  int64_t window;
};

struct PrefillItem {
  int64_t req, hk, i0, i1;  // request, kv head, query tokens [i0, i1) of the request
  int64_t cost;
};

// ---- portable: 8 fp32 lanes in plain C++ -----------------------------------------------------
namespace portable {
struct VecOps {
  static constexpr int64_t W = 8;
  struct V {
    float v[8];
  };
  static inline V zero() { return set1(0.f); }
  static inline V set1(float x) {
    V r;
    for (float& e : r.v) e = x;
    return r;
  }
  static inline V load(const float* p) {
    V r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static inline void store(float* p, V a) { std::memcpy(p, a.v, sizeof(a.v)); }
#define VLLM_PA_LANES(expr) \
  V r;                      \
  for (int i = 0; i < 8; ++i) r.v[i] = (expr); \
  return r;
  static inline V fma(V a, V b, V c) { VLLM_PA_LANES(a.v[i] * b.v[i] + c.v[i]) }
  static inline V mul(V a, V b) { VLLM_PA_LANES(a.v[i] * b.v[i]) }
  static inline V add(V a, V b) { VLLM_PA_LANES(a.v[i] + b.v[i]) }
  static inline V sub(V a, V b) { VLLM_PA_LANES(a.v[i] - b.v[i]) }
  static inline V max(V a, V b) { VLLM_PA_LANES(std::max(a.v[i], b.v[i])) }
  static inline V exp2(V a) { VLLM_PA_LANES(std::exp2(a.v[i])) }
  // s where the key at kpos is visible from the query at qpos, -inf where it is not.
  static inline V select_neg_inf(V s, V kpos, V qpos, bool window, V win) {
    VLLM_PA_LANES((kpos.v[i] > qpos.v[i] || (window && qpos.v[i] - kpos.v[i] >= win.v[i]))
                      ? kPaNegInf
                      : s.v[i])
  }
  static inline V is_neg_inf_to_zero(V a) { VLLM_PA_LANES(a.v[i] == kPaNegInf ? 0.f : a.v[i]) }
#undef VLLM_PA_LANES
};
#include "prefill_attention_body.h"
}  // namespace portable

// 2^x for x <= 0 (x = -inf gives 0): 2^round(x) from the exponent bits times a degree-6
// polynomial of e^y, y = (x - round(x)) ln 2 in [-0.35, 0.35] (truncation error ~1.2e-7, about
// one fp32 ulp).
#define VLLM_PA_EXP2_POLY(FMA, SET1, y)                                               \
  FMA(FMA(FMA(FMA(FMA(FMA(SET1(1.f / 720), y, SET1(1.f / 120)), y, SET1(1.f / 24)), y, \
                  SET1(1.f / 6)),                                                     \
              y, SET1(0.5f)),                                                         \
          y, SET1(1.f)),                                                              \
      y, SET1(1.f))

// The lane-wise ops and exp2 of an x86 VecOps: the same intrinsics at 256 (AVX2) and 512
// (AVX512) bits, named _mm<BITS>_*; ROUND is round-to-nearest, which the two sets name
// differently.
#define VLLM_PA_X86_LANE_OPS(BITS, ROUND)                                                  \
  static constexpr int64_t W = BITS / 32;                                                   \
  using V = __m##BITS;                                                                      \
  static inline V zero() { return _mm##BITS##_setzero_ps(); }                               \
  static inline V set1(float x) { return _mm##BITS##_set1_ps(x); }                          \
  static inline V load(const float* p) { return _mm##BITS##_loadu_ps(p); }                  \
  static inline void store(float* p, V a) { _mm##BITS##_storeu_ps(p, a); }                  \
  static inline V fma(V a, V b, V c) { return _mm##BITS##_fmadd_ps(a, b, c); }              \
  static inline V mul(V a, V b) { return _mm##BITS##_mul_ps(a, b); }                        \
  static inline V add(V a, V b) { return _mm##BITS##_add_ps(a, b); }                        \
  static inline V sub(V a, V b) { return _mm##BITS##_sub_ps(a, b); }                        \
  static inline V max(V a, V b) { return _mm##BITS##_max_ps(a, b); }                        \
  static inline V exp2(V x) {                                                               \
    x = _mm##BITS##_max_ps(x, _mm##BITS##_set1_ps(-127.f));                                 \
    const V n = ROUND(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                    \
    const V y =                                                                             \
        _mm##BITS##_mul_ps(_mm##BITS##_sub_ps(x, n), _mm##BITS##_set1_ps(0.69314718056f));  \
    const V p = VLLM_PA_EXP2_POLY(_mm##BITS##_fmadd_ps, _mm##BITS##_set1_ps, y);            \
    const __m##BITS##i e = _mm##BITS##_slli_epi32(                                          \
        _mm##BITS##_add_epi32(_mm##BITS##_cvtps_epi32(n), _mm##BITS##_set1_epi32(127)), 23); \
    return _mm##BITS##_mul_ps(p, _mm##BITS##_castsi##BITS##_ps(e));                         \
  }

#ifdef VLLM_CPU_X86
// ---- AVX2 + FMA: 8 lanes -------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
struct VecOps {
  VLLM_PA_X86_LANE_OPS(256, _mm256_round_ps)
  static inline V select_neg_inf(V s, V kpos, V qpos, bool window, V win) {
    V hide = _mm256_cmp_ps(kpos, qpos, _CMP_GT_OQ);
    if (window) hide = _mm256_or_ps(hide, _mm256_cmp_ps(_mm256_sub_ps(qpos, kpos), win, _CMP_GE_OQ));
    return _mm256_blendv_ps(s, _mm256_set1_ps(kPaNegInf), hide);
  }
  static inline V is_neg_inf_to_zero(V a) {
    return _mm256_blendv_ps(a, _mm256_setzero_ps(),
                            _mm256_cmp_ps(a, _mm256_set1_ps(kPaNegInf), _CMP_EQ_OQ));
  }
};
#include "prefill_attention_body.h"
}  // namespace avx2
#pragma GCC pop_options

// ---- AVX512F: 16 lanes ---------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")
namespace avx512 {
struct VecOps {
  VLLM_PA_X86_LANE_OPS(512, _mm512_roundscale_ps)
  static inline V select_neg_inf(V s, V kpos, V qpos, bool window, V win) {
    __mmask16 hide = _mm512_cmp_ps_mask(kpos, qpos, _CMP_GT_OQ);
    if (window) hide |= _mm512_cmp_ps_mask(_mm512_sub_ps(qpos, kpos), win, _CMP_GE_OQ);
    return _mm512_mask_blend_ps(hide, s, _mm512_set1_ps(kPaNegInf));
  }
  static inline V is_neg_inf_to_zero(V a) {
    const __mmask16 inf = _mm512_cmp_ps_mask(a, _mm512_set1_ps(kPaNegInf), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(inf, a, _mm512_setzero_ps());
  }
};
#include "prefill_attention_body.h"
}  // namespace avx512
#pragma GCC pop_options
#undef VLLM_PA_X86_LANE_OPS
#endif  // VLLM_CPU_X86

template <typename T>
void run_items(vllm_cpu_isa::Isa isa, const PrefillArgs& a,
               const std::vector<PrefillItem>& items, std::atomic<int64_t>& next,
               int64_t rows_cap) {
  switch (isa) {
#ifdef VLLM_CPU_X86
    case vllm_cpu_isa::kAvx512Bf16:
    case vllm_cpu_isa::kAvx512:
      return avx512::run_items<T>(a, items, next, rows_cap);
    case vllm_cpu_isa::kAvx2:
      return avx2::run_items<T>(a, items, next, rows_cap);
#endif
    default:
      return portable::run_items<T>(a, items, next, rows_cap);
  }
}

template <typename T>
void run(vllm_cpu_isa::Isa isa, at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
         const at::Tensor& query_start_loc, const at::Tensor& rows, int64_t block_size,
         double scale, int64_t window) {
  PrefillArgs a;
  a.q = q.const_data_ptr<T>(), a.qs0 = q.stride(0), a.qs1 = q.stride(1);
  a.k = k_cache.const_data_ptr<T>(), a.ks0 = k_cache.stride(0), a.ks1 = k_cache.stride(1);
  a.v = v_cache.const_data_ptr<T>(), a.vs0 = v_cache.stride(0), a.vs1 = v_cache.stride(1);
  a.out = out.mutable_data_ptr<T>(), a.os0 = out.stride(0), a.os1 = out.stride(1);
  const int64_t H = q.size(1), Hkv = k_cache.size(1);
  a.G = H / Hkv, a.Dk = q.size(2), a.Dv = v_cache.size(2);
  a.bt = block_table.const_data_ptr<int64_t>(), a.bt_stride = block_table.stride(0);
  a.sl = seq_lens.const_data_ptr<int64_t>(), a.qsl = query_start_loc.const_data_ptr<int64_t>();
  a.block_size = block_size;
  a.qscale = static_cast<float>(scale * 1.4426950408889634);  // log2(e)
  a.window = window;
  const int64_t max_blocks = block_table.size(1);

  // Query tiles of about 96 rows (tokens x heads of a group): enough rows that each key row
  // read from the cache serves many queries, few enough that a tile's scratch stays in L2.
  const int64_t want_rows = 96;
  const int64_t bq = std::max<int64_t>(1, want_rows / a.G);
  std::vector<PrefillItem> items;
  const int64_t* rp = rows.const_data_ptr<int64_t>();
  for (int64_t n = 0; n < rows.numel(); ++n) {
    const int64_t r = rp[n];
    const int64_t q_len = a.qsl[r + 1] - a.qsl[r], ctx = a.sl[r] - q_len;
    TORCH_CHECK(q_len >= 0 && ctx >= 0, "prefill_attention: request ", r, " has more query ",
                "tokens (", q_len, ") than tokens (", a.sl[r], ")");
    TORCH_CHECK((a.sl[r] + block_size - 1) / block_size <= max_blocks, "prefill_attention: ",
                "request ", r, " has ", a.sl[r], " tokens but its block table holds only ",
                max_blocks, " blocks of ", block_size);
    for (int64_t i0 = 0; i0 < q_len; i0 += bq) {
      const int64_t i1 = std::min(q_len, i0 + bq);
      const int64_t kend = ctx + i1;
      const int64_t kbeg = window > 0 ? std::max<int64_t>(0, ctx + i0 + 1 - window) : 0;
      for (int64_t hk = 0; hk < Hkv; ++hk)
        items.push_back({r, hk, i0, i1, (i1 - i0) * (kend - kbeg + 16)});
    }
  }
  if (items.empty()) return;
  // Costliest first: the long tail of a causal prefill is its early, cheap tiles.
  std::stable_sort(items.begin(), items.end(),
                   [](const PrefillItem& x, const PrefillItem& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t rows_cap = bq * a.G;
  const int64_t workers =
      std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  // Each worker takes the next item when it is done with one (a busy core slows only itself).
  at::parallel_for(0, workers, 1, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; ++w) run_items<T>(isa, a, items, next, rows_cap);
  });
}

}  // namespace prefill_attention_impl

int64_t prefill_attention_isa(int64_t requested) {
  using namespace vllm_cpu_isa;
  if (requested == kAuto) return best_isa();
  TORCH_CHECK(requested >= kPortable && requested <= kAvx512Bf16,
              "prefill_attention: unknown instruction-set path ", requested);
  TORCH_CHECK(cpu_has(static_cast<Isa>(requested)),
              "prefill_attention: this CPU cannot run instruction-set path ", requested);
  return requested;
}

void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_table,
                       const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                       const at::Tensor& rows, int64_t block_size, double scale,
                       int64_t sliding_window, int64_t isa) {
  TORCH_CHECK(q.device().is_cpu(), "prefill_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && out.dim() == 3,
              "prefill_attention: q [T, H, Dk], k_cache [slots, Hkv, Dk], v_cache [slots, Hkv, "
              "Dv], out [T, H, Dv]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "prefill_attention: q, caches and out must share one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1 &&
                  out.stride(2) == 1,
              "prefill_attention: the head dimension must be contiguous");
  TORCH_CHECK(k_cache.size(1) == v_cache.size(1) && k_cache.size(2) == q.size(2) &&
                  k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0 &&
                  out.size(1) == q.size(1) && out.size(2) == v_cache.size(2) &&
                  out.size(0) == q.size(0),
              "prefill_attention: inconsistent shapes");
  for (const at::Tensor* t : {&block_table, &seq_lens, &query_start_loc, &rows})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "prefill_attention: metadata must be contiguous int64");
  TORCH_CHECK(block_size > 0, "prefill_attention: block_size must be positive");
  TORCH_CHECK(sliding_window >= 0, "prefill_attention: sliding_window must be >= 0");
  const auto path = static_cast<vllm_cpu_isa::Isa>(prefill_attention_isa(isa));
  using prefill_attention_impl::run;
  switch (q.scalar_type()) {
    case at::kFloat:
      run<float>(path, out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, rows,
                 block_size, scale, sliding_window);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(path, out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                         rows, block_size, scale, sliding_window);
      break;
    case at::kHalf:
      run<c10::Half>(path, out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                     rows, block_size, scale, sliding_window);
      break;
    default:
      TORCH_CHECK(false, "prefill_attention: unsupported dtype ", q.scalar_type());
  }
}
