// Small-batch bf16 matmul for decode: out[M, N] = x[M, K] @ w[N, K]^T with fp32 accumulation.
//
// With few rows (a decode step of a handful of requests) a linear layer is bound by reading its weights, and
// oneDNN's bf16 GEMM reaches only a fraction of the memory bandwidth there. This kernel streams every weight row
// from memory once, dots it with all M rows of x (which stay in cache) using AVX512-BF16 dot products, and splits
// the output columns across torch's OpenMP threads. Built only where the CPU has avx512_bf16; elsewhere the model
// keeps F.linear (the capabilities op says which).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"


namespace {

#if PL_AVX512_BF16
constexpr int kRows = 4;  // weight rows dotted together: their K elements stay in L1 across all M rows of x
constexpr int64_t kPrefetchRows = 4;  // software prefetch distance, in weight rows

inline __m512i load_chunk(const uint16_t* p, int64_t remaining) {
  if (remaining >= 32) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << remaining) - 1), p);
}

void gemm_rows(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t M, int64_t N, int64_t K,
               int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) {
    const uint16_t* wr = w + n * K;
    if (n + kPrefetchRows + kRows <= n1) {  // pull the rows a few blocks ahead into cache while these compute
      const char* ahead = reinterpret_cast<const char*>(wr + kPrefetchRows * K);
      for (int64_t b = 0; b < kRows * K * 2; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* xr = x + m * K;
      __m512 acc[kRows];
      for (int j = 0; j < kRows; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 32) {
        __m512bh xv = (__m512bh)load_chunk(xr + k, K - k);
        for (int j = 0; j < kRows; ++j)
          acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)load_chunk(wr + j * K + k, K - k));
      }
      for (int j = 0; j < kRows; ++j) out[m * N + n + j] = pagedllm::f32_to_bf16(_mm512_reduce_add_ps(acc[j]));
    }
  }
  for (; n < n1; ++n) {  // leftover rows, one at a time
    for (int64_t m = 0; m < M; ++m) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)load_chunk(x + m * K + k, K - k),
                               (__m512bh)load_chunk(w + n * K + k, K - k));
      out[m * N + n] = pagedllm::f32_to_bf16(_mm512_reduce_add_ps(acc));
    }
  }
}
#endif

}  // namespace

namespace pagedllm {

void small_gemm_bf16_raw(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t M, int64_t N, int64_t K) {
#if PL_AVX512_BF16
  // Grain: enough rows that one task reads ~64 KiB of weights (fewer, larger tasks wake fewer threads).
  const int64_t grain = std::max<int64_t>(kRows, ((32768 / std::max<int64_t>(K, 1)) + kRows - 1) / kRows * kRows);
  parallel_balanced((N + kRows - 1) / kRows, grain / kRows, [&](int64_t t0, int64_t t1) {
    gemm_rows(x, w, out, M, N, K, t0 * kRows, std::min(N, t1 * kRows));
  });
#else
  TORCH_CHECK(false, "small_gemm_bf16 needs a CPU with avx512_bf16 (the model falls back to F.linear)");
#endif
}

}  // namespace pagedllm

namespace {

void small_gemm_bf16(at::Tensor out, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "small_gemm_bf16: bf16 tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_gemm_bf16: shapes [M,K] x [N,K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "small_gemm_bf16: contiguous only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "small_gemm_bf16: out must be [M, N]");
  pagedllm::small_gemm_bf16_raw(reinterpret_cast<const uint16_t*>(x.data_ptr()),
                                reinterpret_cast<const uint16_t*>(w.data_ptr()),
                                reinterpret_cast<uint16_t*>(out.data_ptr()), M, N, K);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("small_gemm_bf16", &small_gemm_bf16);
}
