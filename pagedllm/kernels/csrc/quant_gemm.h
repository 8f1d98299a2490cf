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
#include "quant_types.h"

namespace pagedllm {

// Weights repacked at load (quant_packed.cpp) have type kPackedBase + their file type.
constexpr int64_t kPackedBase = 1000;

bool quant_type_supported(int64_t qtype);
int64_t quant_row_bytes(int64_t qtype, int64_t K);  // bytes of one stored weight row of K elements (0: unsupported)

// out[M, N] (fp32 if out_f32 else bf16; row stride ldo elements) = x[M, K] @ W^T, where x is bf16 (x_f32 = false)
// or fp32 and W holds N rows of quant_row_bytes(qtype, K) bytes (a packed type: N / 16 interleaved groups). Parallel over N across torch's threads.
void quant_gemm_raw(const void* x, bool x_f32, const uint8_t* w, int64_t qtype, void* out, bool out_f32,
                    int64_t M, int64_t N, int64_t K, int64_t ldo);

// quant_packed.cpp: the 16-row interleaved form of every type (N a multiple of 16, K of the type's block).
bool packable(int64_t base, int64_t N, int64_t K);
bool amx_usable();  // this build has the AMX path, the CPU has AMX and the OS grants the tile state
bool set_matrix_engine(bool on);  // whether the packed GEMM may use AMX where usable; returns the previous setting
int64_t packed_row_bytes(int64_t base, int64_t K);  // 0: not a packable type / K
void quant_gemm_packed(const void* x, bool x_f32, const uint8_t* w, int64_t base, void* out, bool out_f32,
                       int64_t M, int64_t N, int64_t K, int64_t ldo);

}  // namespace pagedllm
