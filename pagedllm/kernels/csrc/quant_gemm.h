// Quantized GGUF linear layers: out[M, N] = x[M, K] @ W[N, K]^T with W in its stored ggml block format.
//
// Every row of x is quantized to int8 per 32-element block (llama.cpp's Q8_0 activations, fp32 scale); every
// weight row is unpacked once per call into unsigned codes q with a scale s and an offset o per 16 elements
// (w = s * q + o: Q4_0 is s = d, o = -8d; Q8_0 is q + 128, o = -128d; K-quants fold their sub-scales and mins in),
// so that one integer dot kernel (AVX-512 VNNI vpdpbusd, u8 x s8) serves all types. Each output is computed the
// same way whatever M is and wherever its row sits in the batch (fixed lane mapping and reduction order).
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedllm {

// ggml type ids (the GGUF file's) this kernel reads.
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// The fp16 value stored (unaligned) at p: block scales.
inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return f16_to_f32(h);
#endif
}

// K-quants' 12-byte packing of eight 6-bit scales and mins (ggml's get_scale_min_k4): sub-block j's codes.
inline void k_scale_min_codes(const uint8_t* s, int j, uint8_t* scale, uint8_t* min) {
  if (j < 4) {
    *scale = s[j] & 63, *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Weights repacked at load (quant_packed.cpp) have type kPackedBase + their file type.
constexpr int64_t kPackedBase = 1000;

bool quant_type_supported(int64_t qtype);
int64_t quant_row_bytes(int64_t qtype, int64_t K);  // bytes of one stored weight row of K elements (0: unsupported)

// out[M, N] (fp32 if out_f32 else bf16; row stride ldo elements) = x[M, K] @ W^T, where x is bf16 (x_f32 = false)
// or fp32 and W holds N rows of quant_row_bytes(qtype, K) bytes (a packed type: N / 16 interleaved groups). Parallel over N across torch's threads.
void quant_gemm_raw(const void* x, bool x_f32, const uint8_t* w, int64_t qtype, void* out, bool out_f32,
                    int64_t M, int64_t N, int64_t K, int64_t ldo);

// quant_packed.cpp: the 16-row interleaved form of Q4_0, Q4_1, Q8_0 and Q4_K (N a multiple of 16).
bool packable(int64_t base, int64_t N, int64_t K);
int64_t packed_row_bytes(int64_t base, int64_t K);  // 0: not a packable type / K
void quant_gemm_packed(const void* x, bool x_f32, const uint8_t* w, int64_t base, void* out, bool out_f32,
                       int64_t M, int64_t N, int64_t K, int64_t ldo);

}  // namespace pagedllm
