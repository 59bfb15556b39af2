// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors

//
// The one translation unit of the CPU kernels: the kernel files are included here (a unity
// build) so that torch's heavy headers are parsed once - about a third of the JIT build time of
// compiling each file on its own.

#include <torch/library.h>

#include "cache_ops.cpp"
#include "layernorm.cpp"
#include "linear.cpp"
#include "ops.h"
#include "paged_attention.cpp"
#include "pos_encoding.cpp"
#include "prefill_attention.cpp"

TORCH_LIBRARY(vllm_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, Tensor rows, "
      "int block_size, float scale, int blocks_per_split, Tensor? tree_mask=None) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos_cache, "
      "Tensor sin_cache, int head_size, int rotary_dim, bool is_neox) -> (Tensor, Tensor)");
  m.def("linear_small_m(Tensor x, Tensor weight, Tensor? bias, int isa=0) -> Tensor");
  m.def("linear_small_m_isa(int requested) -> int", &linear_small_m_isa);
  m.def(
      "prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, Tensor rows, "
      "int block_size, float scale, int sliding_window, int isa) -> ()");
  m.def("prefill_attention_isa(int requested) -> int", &prefill_attention_isa);
  m.def("write_kv(Tensor(a!) kv_cache, Tensor slot_mapping, Tensor k, Tensor v) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("linear_small_m", &linear_small_m);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("write_kv", &write_kv);
  m.impl("silu_and_mul", &silu_and_mul);
}
