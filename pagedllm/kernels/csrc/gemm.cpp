// Batch-invariant linear: out[M, N] = x[M, K] @ w[N, K]^T for fp32 or bf16 tensors, fp32 arithmetic.
//
// oneDNN (and the small GEMM below its row threshold) pick their kernels and their K blocking by M, so a row's
// result changes in the last bits with the number of rows in the batch, and a greedy token can flip. Here every
// output element is computed the same way whatever M is and whichever thread computes it: 16 fp32 lanes, lane l
// accumulating x[k] * w[k] for k = l (mod 16) in increasing k (the K tail loaded as zeros), then the 16 lanes
// summed by one fixed tree. Tiles of up to kTileRows x rows by kTileCols weight rows share their loads; a smaller
// tile (the last rows, the last columns, a decode step) does the same arithmetic per element. AVX-512 builds run it
// on FMAs and reduce16; every other build has the same scheme in plain C++, so the default (invariant) mode runs
// on any CPU. On AVX512-BF16 builds bf16 operands take vdpbf16ps instead, twice the multiply-adds per instruction
// and no widening pass: lane l accumulates the pairs k = 2l, 2l + 1 (mod 32) in increasing k (the instruction's own
// fixed order and rounding), then the same tree; still the same per element whatever M is, in other bits than
// the fp32 scheme. `pagedllm bench throughput --kernels both` compares the model on this kernel with oneDNN.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

constexpr int kLanes = 16;         // partial sums per output element (lane l: k = l mod 16)
constexpr int64_t kRowBlock = 64;  // x rows widened per pass over a thread's weight rows (they stay in L2)
#if PL_AVX512
constexpr int kTileRows = 4;  // x rows per tile
constexpr int kTileCols = 4;  // weight rows (output columns) per tile: kTileRows x kTileCols accumulators
#else
constexpr int kTileRows = 2;  // fewer registers (16 ymm at most): 2 x 2 accumulators of two ymm each
constexpr int kTileCols = 2;
#endif

// rows x K elements of src (bf16 or fp32) into dst as fp32 rows of kp floats (kp = K rounded up to 16, zeros).
void widen_rows(const void* src, bool bf16, int64_t rows, int64_t K, int64_t kp, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    float* d = dst + r * kp;
    if (bf16) {
      const uint16_t* s = static_cast<const uint16_t*>(src) + r * K;
      int64_t k = 0;
#if PL_AVX512
      for (; k + 16 <= K; k += 16) _mm512_storeu_ps(d + k, pagedllm::load_bf16(s + k));
#endif
      for (; k < K; ++k) d[k] = pagedllm::bf16_to_f32(s[k]);
    } else {
      const float* s = static_cast<const float*>(src) + r * K;
      std::copy(s, s + K, d);
    }
    std::fill(d + K, d + kp, 0.f);
  }
}

#if PL_AVX512
// The R x kTileCols dot products of rows xr[0..R) with wr[0..kTileCols), into sums[i * kTileCols + j].
template <int R>
inline void tile(const float* const* xr, const float* wr, int64_t kp, float* sums) {
  __m512 acc[16];
  for (int a = 0; a < 16; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kp; k += kLanes) {
    __m512 wv[kTileCols];
    for (int j = 0; j < kTileCols; ++j) wv[j] = _mm512_loadu_ps(wr + j * kp + k);
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_loadu_ps(xr[i] + k);
      for (int j = 0; j < kTileCols; ++j) acc[i * kTileCols + j] = _mm512_fmadd_ps(xv, wv[j], acc[i * kTileCols + j]);
    }
  }
  _mm512_storeu_ps(sums, pagedllm::reduce16(acc));
}
#elif PL_AVX2
// The same scheme on AVX2: an element's 16 lanes are two ymm accumulators (lanes 0-7, 8-15), one FMA per lane in
// increasing k, then the plain tree below (l += l + 8, + 4, + 2, + 1) in vector form.
inline float reduce16_avx2(__m256 lo, __m256 hi) {
  return pagedllm::sum8(_mm256_add_ps(lo, hi));
}

template <int R>
inline void tile(const float* const* xr, const float* wr, int64_t kp, float* sums) {
  __m256 acc[R][kTileCols][2];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kTileCols; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kp; k += kLanes) {
    __m256 w[kTileCols][2];
    for (int j = 0; j < kTileCols; ++j) {
      w[j][0] = _mm256_loadu_ps(wr + j * kp + k);
      w[j][1] = _mm256_loadu_ps(wr + j * kp + k + 8);
    }
    for (int i = 0; i < R; ++i) {
      const __m256 x0 = _mm256_loadu_ps(xr[i] + k), x1 = _mm256_loadu_ps(xr[i] + k + 8);
      for (int j = 0; j < kTileCols; ++j) {
        acc[i][j][0] = _mm256_fmadd_ps(x0, w[j][0], acc[i][j][0]);
        acc[i][j][1] = _mm256_fmadd_ps(x1, w[j][1], acc[i][j][1]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kTileCols; ++j) sums[i * kTileCols + j] = reduce16_avx2(acc[i][j][0], acc[i][j][1]);
}
#else
// The same scheme in plain C++ (the compiler vectorises the lane loop for the ISA the build allows): 16 lane sums
// per element in increasing k, then one fixed pairwise tree over the lanes.
template <int R>
inline void tile(const float* const* xr, const float* wr, int64_t kp, float* sums) {
  float acc[R][kTileCols][kLanes] = {};
  for (int64_t k = 0; k < kp; k += kLanes)
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < kTileCols; ++j)
        for (int l = 0; l < kLanes; ++l) acc[i][j][l] += xr[i][k + l] * wr[j * kp + k + l];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kTileCols; ++j) {
      float* a = acc[i][j];
      for (int half = kLanes / 2; half > 0; half /= 2)
        for (int l = 0; l < half; ++l) a[l] += a[l + half];
      sums[i * kTileCols + j] = a[0];
    }
}
#endif

#if PL_AVX512_BF16
// The bf16 elements k.. of a row of K that one vdpbf16ps takes: 32, fewer (the rest zeros) at the K tail.
inline __m512bh load32_bf16(const uint16_t* row, int64_t k, int64_t K) {
  const __mmask32 m = K - k >= 32 ? static_cast<__mmask32>(0xffffffffu) : static_cast<__mmask32>((1u << (K - k)) - 1u);
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, row + k));
}

// The bf16 path: kTileRows x kTileCols dot products of bf16 rows, 32 elements (16 pairs) per vdpbf16ps.
inline void tile_bf16(const uint16_t* const* xr, const uint16_t* const* wr, int64_t K, float* sums) {
  __m512 acc[16];
  for (int a = 0; a < 16; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[kTileCols];
    for (int j = 0; j < kTileCols; ++j) wv[j] = load32_bf16(wr[j], k, K);
    for (int i = 0; i < kTileRows; ++i) {
      const __m512bh xv = load32_bf16(xr[i], k, K);
      for (int j = 0; j < kTileCols; ++j) acc[i * kTileCols + j] = _mm512_dpbf16_ps(acc[i * kTileCols + j], xv, wv[j]);
    }
  }
  _mm512_storeu_ps(sums, pagedllm::reduce16(acc));
}

// One x row against the kTileCols weight rows, the same sums as tile_bf16 gives that row, one weight row after the
// other: a decode step reads the weights as one sequential stream (four short interleaved streams were slower on
// narrow rows).
inline void row_bf16(const uint16_t* x, const uint16_t* const* wr, int64_t K, float* sums) {
  __m512 acc[16];
  for (int a = 0; a < 16; ++a) acc[a] = _mm512_setzero_ps();
  for (int j = 0; j < kTileCols; ++j)
    for (int64_t k = 0; k < K; k += 32) acc[j] = _mm512_dpbf16_ps(acc[j], load32_bf16(x, k, K), load32_bf16(wr[j], k, K));
  _mm512_storeu_ps(sums, pagedllm::reduce16(acc));
}
#endif

void store(void* out, bool bf16, int64_t idx, float v) {
  if (bf16)
    static_cast<uint16_t*>(out)[idx] = pagedllm::f32_to_bf16(v);
  else
    static_cast<float*>(out)[idx] = v;
}

#if PL_AVX512_BF16
// Output columns [n0, n1) for all M rows, bf16 operands read in place (kRowBlock rows of x stay in L2 while the
// columns' weight rows pass).
void gemm_columns_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t M, int64_t N, int64_t K,
                       int64_t n0, int64_t n1) {
  alignas(64) float sums[16];
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t mrows = std::min(kRowBlock, M - m0);
    for (int64_t n = n0; n < n1; n += kTileCols) {
      const int64_t ncols = std::min<int64_t>(kTileCols, n1 - n);
      const uint16_t* wr[kTileCols];
      for (int64_t j = 0; j < kTileCols; ++j) wr[j] = w + (n + std::min(j, ncols - 1)) * K;  // spare columns: dropped
      for (int64_t i = 0; i < mrows;) {
        const int64_t r = mrows - i >= kTileRows ? kTileRows : 1;
        const uint16_t* xr[kTileRows];
        for (int64_t a = 0; a < r; ++a) xr[a] = x + (m0 + i + a) * K;
        if (r == kTileRows)
          tile_bf16(xr, wr, K, sums);
        else
          row_bf16(xr[0], wr, K, sums);
        for (int64_t a = 0; a < r; ++a)
          for (int64_t j = 0; j < ncols; ++j) out[(m0 + i + a) * N + n + j] = pagedllm::f32_to_bf16(sums[a * kTileCols + j]);
        i += r;
      }
    }
  }
}
#endif

// Output columns [n0, n1) for all M rows.
void gemm_columns(const void* x, const void* w, void* out, bool bf16, int64_t M, int64_t N, int64_t K, int64_t n0,
                  int64_t n1) {
#if PL_AVX512_BF16
  if (bf16)
    return gemm_columns_bf16(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
                             static_cast<uint16_t*>(out), M, N, K, n0, n1);
#endif
  const int64_t kp = (K + kLanes - 1) / kLanes * kLanes;
  std::vector<float> xbuf(std::min(M, kRowBlock) * kp), wbuf(kTileCols * kp);
  const size_t esz = bf16 ? 2 : 4;
  alignas(64) float sums[16];
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t mrows = std::min(kRowBlock, M - m0);
    widen_rows(static_cast<const char*>(x) + m0 * K * esz, bf16, mrows, K, kp, xbuf.data());
    for (int64_t n = n0; n < n1; n += kTileCols) {
      const int64_t ncols = std::min<int64_t>(kTileCols, n1 - n);
      widen_rows(static_cast<const char*>(w) + n * K * esz, bf16, ncols, K, kp, wbuf.data());
      for (int64_t j = ncols; j < kTileCols; ++j) std::fill(wbuf.begin() + j * kp, wbuf.begin() + (j + 1) * kp, 0.f);
      for (int64_t i = 0; i < mrows;) {
        const int64_t r = mrows - i >= kTileRows ? kTileRows : 1;
        const float* xr[kTileRows];
        for (int64_t a = 0; a < r; ++a) xr[a] = xbuf.data() + (i + a) * kp;
        if (r == kTileRows)
          tile<kTileRows>(xr, wbuf.data(), kp, sums);
        else
          tile<1>(xr, wbuf.data(), kp, sums);
        for (int64_t a = 0; a < r; ++a)
          for (int64_t j = 0; j < ncols; ++j) store(out, bf16, (m0 + i + a) * N + n + j, sums[a * kTileCols + j]);
        i += r;
      }
    }
  }
}

}  // namespace

namespace pagedllm {

void gemm_invariant_raw(const void* x, const void* w, void* out, bool bf16, int64_t M, int64_t N, int64_t K) {
  // columns across threads in whole tiles; a task streams at least ~64 KiB of weights
  const int64_t grain = std::max<int64_t>(kTileCols, (16384 / std::max<int64_t>(K, 1) + kTileCols - 1) / kTileCols *
                                                         kTileCols);
  const int64_t tiles = (N + kTileCols - 1) / kTileCols;
  parallel_balanced(tiles, std::max<int64_t>(1, grain / kTileCols), [&](int64_t t0, int64_t t1) {
    gemm_columns(x, w, out, bf16, M, N, K, t0 * kTileCols, std::min(N, t1 * kTileCols));
  });
}

}  // namespace pagedllm

namespace {

void gemm_invariant(at::Tensor out, const at::Tensor& x, const at::Tensor& w) {
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == at::kBFloat16 || dt == at::kFloat) && w.scalar_type() == dt && out.scalar_type() == dt,
              "gemm_invariant: x, w and out must all be float32 or all bfloat16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemm_invariant: shapes [M,K] x [N,K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(), "gemm_invariant: contiguous only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N, "gemm_invariant: out must be [M, N]");
  if (M == 0 || N == 0) return;
  pagedllm::gemm_invariant_raw(x.data_ptr(), w.data_ptr(), out.data_ptr(), dt == at::kBFloat16, M, N, K);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) { m.def("gemm_invariant", &gemm_invariant); }
