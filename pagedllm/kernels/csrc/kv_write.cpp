// The K/V write of an int8 KV cache: each new (token, KV head) row quantized and scattered into its slot in one
// pass (the float pools are written by torch's index_copy_). Row layout and rounding as attention/kv_quant.py:
// scale = f16(min(max|x| / 127, 65504)), q = round_half_even(x / scale) clamped to [-127, 127], all in fp32, so
// the two write the same bytes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace pagedllm {
namespace {

constexpr int64_t kScaleBytes = 2;
constexpr int64_t kRowsPerTask = 64;  // (token, head) rows per parallel task

// One row of d values (fp32 or bf16) -> d int8 values and the float16 scale after them. x: d floats of scratch.
template <typename T>
void quantize_row(const T* src, int8_t* dst, int64_t d, float* x) {
  float amax = 0.f;
  for (int64_t e = 0; e < d; ++e) {
    if constexpr (sizeof(T) == 2) {
      x[e] = bf16_to_f32(src[e]);
    } else {
      x[e] = src[e];
    }
    amax = std::max(amax, std::fabs(x[e]));
  }
  const uint16_t h = f32_to_f16(std::min(amax / 127.f, 65504.f));
  const float s = f16_to_f32(h);
  for (int64_t e = 0; e < d; ++e) {
    const float q = s > 0.f ? std::nearbyint(x[e] / s) : 0.f;
    dst[e] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
  }
  std::memcpy(dst + d, &h, sizeof h);
}

template <typename T>
void write_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots, int64_t tokens, int64_t hkv,
                int64_t d) {
  const T* src = reinterpret_cast<const T*>(x.data_ptr());
  int8_t* dst = cache.data_ptr<int8_t>();
  const int64_t ts = x.stride(0), hs = x.stride(1), row = d + kScaleBytes;
  at::parallel_for(0, tokens * hkv, kRowsPerTask, [&](int64_t b, int64_t e) {
    float buf[512];
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / hkv, h = i % hkv;
      quantize_row(src + t * ts + h * hs, dst + (slots[t] * hkv + h) * row, d, buf);
    }
  });
}

// k, v [T, Hkv, D] (fp32 or bf16, last dim contiguous) into the int8 caches [blocks, block_size, Hkv, D + 2] at
// slot_mapping [T] (int64).
void write_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                   const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "write_kv_int8: caches must be contiguous int8 [blocks, block_size, kv_heads, head_dim + 2]");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16) && k.stride(2) == 1 &&
                  v.stride(2) == 1 && k.stride(0) == v.stride(0) && k.stride(1) == v.stride(1),
              "write_kv_int8: k, v must be float32 or bfloat16 [tokens, kv_heads, head_dim] with equal strides");
  const int64_t tokens = k.size(0), hkv = k.size(1), d = k.size(2);
  TORCH_CHECK(k_cache.size(2) == hkv && k_cache.size(3) == d + kScaleBytes && d <= 512,
              "write_kv_int8: cache rows do not match k's heads / head_dim");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == tokens,
              "write_kv_int8: slot_mapping must be contiguous int64 [tokens]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv_int8: slot ", slots[t], " out of range");
  if (k.scalar_type() == at::kBFloat16) {
    write_rows<uint16_t>(k, k_cache, slots, tokens, hkv, d);
    write_rows<uint16_t>(v, v_cache, slots, tokens, hkv, d);
  } else {
    write_rows<float>(k, k_cache, slots, tokens, hkv, d);
    write_rows<float>(v, v_cache, slots, tokens, hkv, d);
  }
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) { m.def("write_kv_int8", &pagedllm::write_kv_int8); }
