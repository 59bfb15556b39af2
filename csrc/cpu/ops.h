// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors
//
// CPU kernels registered as torch.ops.vllm_cpu.* (torch_bindings.cpp).

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& rows, int64_t block_size, double scale,
                     int64_t blocks_per_split, const c10::optional<at::Tensor>& tree_mask);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions,
                                                    const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& cos_cache,
                                                    const at::Tensor& sin_cache,
                                                    int64_t head_size, int64_t rotary_dim,
                                                    bool is_neox);

at::Tensor linear_small_m(const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias, int64_t isa);

// Causal attention of the long-query (prefill / chunked-prefill) requests in `rows`, read
// straight from the paged cache; sliding_window > 0: a query at position p sees keys in
// (p - sliding_window, p]. isa: as linear_small_m's (0: the best this CPU has).
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_table,
                       const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                       const at::Tensor& rows, int64_t block_size, double scale,
                       int64_t sliding_window, int64_t isa);

// The instruction-set path prefill_attention runs for `requested`; raises like
// linear_small_m_isa.
int64_t prefill_attention_isa(int64_t requested);

// The instruction-set path linear_small_m runs for `requested` (0: the best this CPU has);
// raises when the CPU lacks the requested one.
int64_t linear_small_m_isa(int64_t requested);

// The step's keys and values ([tokens, kv_heads, head_size], each token's contiguous) into
// kv_cache [2, slots, kv_heads, head_size] at slot_mapping (negative: padding, not written).
void write_kv(at::Tensor kv_cache, const at::Tensor& slot_mapping, const at::Tensor& k,
              const at::Tensor& v);

// silu(x[..., :d]) * x[..., d:] by ATen's silu and multiply (the torch path's result).
at::Tensor silu_and_mul(const at::Tensor& x);
