// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 The vllm-pp-spec contributors
//
// The instruction-set paths the CPU kernels pick at run time (cpuid), shared by the small-M
// linear kernel and the prefill attention kernel, so one build runs on AVX2-only and
// AVX512-BF16 machines alike: each path is compiled with its own target attribute / pragma.

#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define VLLM_CPU_X86 1
#endif

namespace vllm_cpu_isa {

enum Isa : int64_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3, kAvx512Bf16 = 4 };

inline bool cpu_has(Isa isa) {
  switch (isa) {
    case kPortable:
      return true;
#ifdef VLLM_CPU_X86
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
    case kAvx512Bf16:
      return cpu_has(kAvx512) && __builtin_cpu_supports("avx512bf16");
#endif
    default:
      return false;
  }
}

inline Isa best_isa() {
  for (Isa isa : {kAvx512Bf16, kAvx512, kAvx2})
    if (cpu_has(isa)) return isa;
  return kPortable;
}

}  // namespace vllm_cpu_isa
