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

#include "ops.h"

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

template <typename T>
inline void load_row(float* __restrict dst, const T* __restrict src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void store_row(T* __restrict dst, const float* __restrict src, float mul, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * mul);
}

struct Split {
  int64_t req;          // index into query_start_loc / seq_lens / block_table
  int64_t block_begin;  // logical cache blocks [block_begin, block_end) of this item
  int64_t block_end;
  int64_t part;  // slot in the partial-result buffers, -1 when this item owns the request
};

template <typename scalar_t>
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
    const int64_t want_items = 4 * static_cast<int64_t>(at::get_num_threads());
    const int64_t items_now = std::max<int64_t>(num_rows * Hkv, 1);
    const int64_t per_row = std::max<int64_t>(total_blocks / std::max<int64_t>(num_rows, 1), 1);
    const int64_t nsplit = std::max<int64_t>((want_items + items_now - 1) / items_now, 1);
    // At least 4 blocks per split: merging partials is not free.
    bps = std::max<int64_t>((per_row + nsplit - 1) / nsplit, 4);
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
    std::vector<float> qbuf, acc, m, l, kbuf(block_size * Dk), vbuf(block_size * Dv),
        scores(block_size);
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
  switch (q.scalar_type()) {
    case at::kFloat:
      run<float>(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, rows,
                 block_size, scale, blocks_per_split, tree, tree_m);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, rows,
                         block_size, scale, blocks_per_split, tree, tree_m);
      break;
    case at::kHalf:
      run<c10::Half>(out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc, rows,
                     block_size, scale, blocks_per_split, tree, tree_m);
      break;
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
}
