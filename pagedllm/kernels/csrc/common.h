// What the extension's translation units share: bf16 <-> fp32 conversions and the entry points one kernel calls
// in another (the fused decoder layer calls the small GEMM and paged attention directly, not through torch.ops).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "isa.h"

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

// IEEE half <-> float, round to nearest even (the int8 KV rows' scales; torch's float16 conversion gives the same).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while (!(man & 0x400u));
    u = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (a >= 0x38800000u) {  // normal half
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
    return sign | static_cast<uint16_t>(r >> 13);
  }
  if (a < 0x33000000u) return sign;  // below half the smallest subnormal (or exactly it: ties to even, 0)
  // subnormal half: the mantissa with its implicit bit, shifted right with round to nearest even
  const uint32_t man = (a & 0x7fffffu) | 0x800000u;
  const int shift = 126 - static_cast<int>(a >> 23);  // 14..24
  const uint32_t half_ulp = 1u << (shift - 1), rem = man & ((1u << shift) - 1u);
  uint32_t r = man >> shift;
  if (rem > half_ulp || (rem == half_ulp && (r & 1u))) ++r;
  return sign | static_cast<uint16_t>(r);
}

#if PL_AVX512
// 16 bf16 values widened to fp32 (a bf16 is the upper half of an fp32's bits).
inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

inline __m512 load_bf16(const uint16_t* src) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}

// 16 floats stored as bf16, bit for bit as f32_to_bf16 rounds them (in integers: any AVX-512 build, BF16 or not).
inline void store_bf16(uint16_t* dst, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));  // a NaN kept, made quiet
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

// exp(x): x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for the reduction), e^r by its degree-6 Taylor
// polynomial (relative error ~1e-7), times 2^n with scalef. Below -104 (0 in float) x is clamped.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 y = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(y, n);
}

// out[j] = horizontal sum of v[j], j = 0..15, by one fixed tree (lanes i, i + 2 of each 128-bit block, then i,
// i + 1, then the blocks 0 + 1, 2 + 3, then the two halves): lane j depends on v[j] only, so a sum does not depend
// on what the other vectors hold.
inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
    u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int k = 0; k < 2; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
#endif

#if PL_AVX2
// The sum of 8 lanes (halves, then pairs, then the last two).
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp(x) in 8 lanes, as exp_ps above with 2^n built in the exponent bits: x is clamped to [-87, 88] (the normal
// floats' range), so a result below 1.6e-38 or above 1.6e38 is that bound, not 0 or inf (silu and gelu then
// divide by it or add it to 1: a difference below 1e-36).
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 y = _mm256_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}
#endif

// f(b, e) over [0, n) across torch's threads: each thread owns an equal share, works through it from the front
// in chunks of min_chunk, and then takes half of what is left of another thread's share from its back. A static
// split alone left one thread waiting at every region's end for the other, whose share of the memory bandwidth
// happened to be smaller (a decode step's GEMMs are ~10-400 us each). A thread's own claims are contiguous (its
// stream stays one for the prefetchers) and touch only its own share's counter, so a balanced region costs what a
// static one does. Which thread computes a chunk never changes what it computes.
template <class F>
void parallel_balanced(int64_t n, int64_t min_chunk, const F& f) {
  min_chunk = std::max<int64_t>(1, min_chunk);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + min_chunk - 1) / min_chunk);
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) f(int64_t{0}, n);
    return;
  }
  TORCH_CHECK(n < (int64_t{1} << 31), "parallel_balanced: range too large");
  struct alignas(64) Share {
    std::atomic<uint64_t> span;  // front (low 32 bits) and back (high 32 bits) of what is left
  };
  const auto pack = [](uint64_t front, uint64_t back) { return front | back << 32; };
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t) shares[t].span = pack(n * t / threads, n * (t + 1) / threads);
  // Claims [b, e) of share s: from its front (own = true: at most min_chunk) or half of the rest from its back.
  const auto claim = [&](Share& s, bool own, int64_t* b, int64_t* e) {
    uint64_t span = s.span.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(span & 0xffffffffu), back = static_cast<int64_t>(span >> 32);
      if (front >= back) return false;
      uint64_t rest;
      if (own) {
        *b = front, *e = std::min(back, front + min_chunk), rest = pack(*e, back);
      } else {
        *b = std::max(front, back - std::max(min_chunk, (back - front) / 2)), *e = back, rest = pack(front, *b);
      }
      if (s.span.compare_exchange_weak(span, rest, std::memory_order_relaxed)) return true;
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    int64_t b, e;
    for (int64_t t = t0; t < t1; ++t) {
      while (claim(shares[t], true, &b, &e)) f(b, e);
      for (int64_t k = 1; k < threads; ++k)
        while (claim(shares[(t + k) % threads], false, &b, &e)) f(b, e);
    }
  });
}

// How a kernel may compute: Python's kernels.dispatch.KernelMode, which the ops take as its two fields.
struct KernelMode {
  bool portable;   // the plain C++ paths only (the oracle of the vector paths)
  bool invariant;  // batch-invariant: a row's result never depends on the other rows of the batch
};

// paged_attention.cpp: out[T,Hq,D] = attention of q over the paged K/V; window > 0: each query sees only its
// `window` most recent keys (itself included); sinks [Hq] float32 (gpt-oss): one logit per query head that joins
// the softmax's denominator and adds no value.
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor seq_lens, at::Tensor query_start_loc, double scale, bool portable, bool invariant,
                     int64_t min_items, int64_t window, const std::optional<at::Tensor>& sinks);

// moe.cpp: a token's routing (route_row) and a step's experts (the moe_experts op; the fused layer calls both).
void route_row(const float* logits, int64_t E, int64_t k, bool renormalize, int64_t* experts, float* weights);
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                       const at::Tensor& gate_up_ptrs, const at::Tensor& down_ptrs, int64_t gate_up_qtype,
                       int64_t down_qtype, int64_t intermediate, const std::optional<at::Tensor>& gate_up_bias,
                       const std::optional<at::Tensor>& down_bias, int64_t glu_kind, double limit, double alpha);

// Up to this many rows a bf16 linear runs on the small GEMM (bandwidth-bound: each weight row streamed once for
// all rows), beyond on oneDNN. Python reads it through the small_gemm_max_rows op.
constexpr int64_t kSmallGemmMaxRows = 4;

// gemm.cpp: out[M,N] = x[M,K] @ w[N,K]^T (fp32 or bf16, bf16 = true), every element summed in one fixed order
// whatever M is (batch-invariant). Every build has it (a vector and a portable form).
void gemm_invariant_raw(const void* x, const void* w, void* out, bool bf16, int64_t M, int64_t N, int64_t K);

// small_gemm.cpp: out[M,N] = x[M,K] @ w[N,K]^T, bf16 in and out, fp32 accumulation, across torch's threads.
// Only where the build has AVX512-BF16 (PL_AVX512_BF16).
void small_gemm_bf16_raw(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t M, int64_t N, int64_t K);

// huge_pages.cpp: uint8 [rows, cols] in memory advised as 2 MiB pages (what a decode step streams whole).
at::Tensor empty_huge_paged(int64_t rows, int64_t cols);

}  // namespace pagedllm
