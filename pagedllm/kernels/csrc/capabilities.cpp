// The capabilities op: what this build of the extension can run. kernels/dispatch.py asks once and decides every
// kernel choice from the answer (an op whose capability is absent is never called).

#include <torch/library.h>

#include <string>

#include "attention.h"
#include "quant_gemm.h"

namespace {

c10::Dict<std::string, int64_t> capabilities() {
  c10::Dict<std::string, int64_t> caps;
  caps.insert("avx512", PL_AVX512);            // fp32 vector paths
  caps.insert("fused_layer", PL_AVX512 || PL_AVX2);  // the fused fp32 decoder layer (decoder_layer.cpp)
  caps.insert("avx512_bf16", PL_AVX512_BF16);  // the bf16 small GEMM, fused bf16 layer and bf16 attention paths
  caps.insert("vnni", PL_VNNI);                // int8 dot products: quantized GEMMs, int8-KV attention
  caps.insert("amx", pagedllm::amx_usable());  // the packed GEMM's AMX tiles (this CPU and OS, not only the build)
  caps.insert("int8_gemm", PL_VNNI || PL_INT8_AVX2);  // the packed quantized GEMM's products in vector code
  caps.insert("small_gemm_max_rows", PL_AVX512_BF16 ? pagedllm::kSmallGemmMaxRows : 0);
  // head dims (a mask of powers of two) whose attention has vector paths; with vnni, int8 KV there rounds q
  caps.insert("vector_head_dims", PL_AVX512 ? pagedllm::attn::kVectorHeadDims : 0);
  return caps;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) { m.def("capabilities", &capabilities); }
