// What the extension's translation units share: bf16 <-> fp32 conversions and the entry points one kernel calls
// in another (the fused decoder layer calls the small GEMM and paged attention directly, not through torch.ops).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>

namespace pagedllm {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, quiet NaN kept
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// paged_attention.cpp: out[T,Hq,D] = attention of q over the paged K/V (impl 0 = fastest, 1 = portable).
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor seq_lens, at::Tensor query_start_loc, double scale, int64_t impl, int64_t min_items);

// small_gemm.cpp: out[M,N] = x[M,K] @ w[N,K]^T, bf16 in and out, fp32 accumulation, across torch's threads.
// Only where the build has AVX512-BF16 (small_gemm_available()).
bool small_gemm_available();
void small_gemm_bf16_raw(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t M, int64_t N, int64_t K);

}  // namespace pagedllm
