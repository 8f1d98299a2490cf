// Quantized linears on GGUF weights repacked once at load: 16 weight rows interleaved per group, one row per
// fp32 lane, so that the int8 dot (AVX-512 VNNI vpdpbusd, u8 codes x s8 activations) sums each row in its own
// lane and no horizontal reduction is ever needed (llama.cpp's "x16" repacks follow the same idea).
//
// A packed matrix keeps the file's bits (same bytes per row for Q4_0/Q4_1/Q8_0, +2.8% for Q4_K), regrouped:
//   group g = rows 16g..16g+15, units of U elements (32; 256 for Q4_K), each unit of the group contiguous:
//   Q4_0  [codes 256 B][d: 16 x f16]                 Q4_1  [codes 256 B][d: 16 x f16][m: 16 x f16]
//   Q8_0  [codes 512 B][d: 16 x f16]                 Q4_K  [d: 16 x f16][dmin: 16 x f16] then 8 x 32-blocks of
//                                                          [codes 256 B][scale: 16 x u8][min: 16 x u8]
// codes of a 32-element block: 4-bit types in 4 vectors of 64 bytes, vector j lane i = row i's bytes 4j..4j+3
// (low nibbles: elements 4j..4j+3, high nibbles: 16 + 4j..), 8-bit types in 8 vectors (vector s lane i = row i's
// elements 4s..4s+3, as s8 + 128). Every block is w = ws * code + wo with per-row fp32 ws, wo (Q4_0: d, -8d;
// Q4_1: d, m; Q8_0: d, -128d; Q4_K: d * scale, -dmin * min, all exact in fp32).
//
// Activations: each row quantized to int8 per 32 elements (scale da = amax / 127, round half to even) with
// dsa = da * sum(codes). out[m, n] = sum over blocks, in order, of
//   acc = fma(float(isum), ws * da, acc); acc = fma(wo, dsa, acc)      (isum = the exact int32 dot)
// The VNNI and the portable path compute exactly this, per output, whatever M is: batch-invariant and equal.

#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "common.h"
#include "quant_gemm.h"


namespace pagedllm {
namespace {

constexpr int64_t kGroupRows = 16;
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead of the dot the weight stream is prefetched

struct PackedType {
  int64_t unit, row_bytes;  // elements per unit, bytes per row and unit (= the file's bytes for those elements)
  bool four_bit;
};

constexpr PackedType packed_type(int64_t base) {
  switch (base) {
    case kQ4_0: return {32, 18, true};
    case kQ4_1: return {32, 20, true};
    case kQ8_0: return {32, 34, false};
    case kQ4_K: return {256, 148, true};
    default: return {0, 0, false};
  }
}

constexpr int64_t code_bytes(bool four_bit) { return four_bit ? 256 : 512; }

// Where byte c (0..31) of row `row` sits in a block's code vectors: vector c / 4, lane row, byte c % 4.
constexpr int64_t lane_byte(int64_t c, int64_t row) { return (c / 4) * 64 + row * 4 + c % 4; }

// ---- packing ------------------------------------------------------------------------------------------------
// One row's 32 codes (element order, values < 16) into a 4-bit block at lane `row`.
void place_nibbles(const uint8_t* codes, int64_t row, uint8_t* dst) {
  for (int c = 0; c < 16; ++c) dst[lane_byte(c, row)] = codes[c] | (codes[c + 16] << 4);
}

// Row `row`'s unit (the file's bytes at src) into its lanes of a packed unit. Packing a 1B model touches every
// byte once, so the common types move whole 4-byte lane words (a load is ~10x faster than byte by byte).
template <int64_t base>
void pack_unit(const uint8_t* src, int64_t row, uint8_t* dst) {
  auto put_f16 = [](uint8_t* at, const uint8_t* from) { std::memcpy(at, from, 2); };
  if constexpr (base == kQ4_0 || base == kQ4_1) {
    const uint8_t* qs = src + (base == kQ4_0 ? 2 : 4);  // byte c: element c low, c + 16 high, as placed
    for (int j = 0; j < 4; ++j) std::memcpy(dst + lane_byte(4 * j, row), qs + 4 * j, 4);
    put_f16(dst + 256 + 2 * row, src);
    if constexpr (base == kQ4_1) put_f16(dst + 288 + 2 * row, src + 2);
  } else if constexpr (base == kQ8_0) {
    for (int s = 0; s < 8; ++s) {
      uint32_t four;
      std::memcpy(&four, src + 2 + 4 * s, 4);
      four ^= 0x80808080u;  // s8 -> u8 + 128, per byte
      std::memcpy(dst + lane_byte(4 * s, row), &four, 4);
    }
    put_f16(dst + 512 + 2 * row, src);
  } else {  // Q4_K
    uint8_t codes[32];
    put_f16(dst + 2 * row, src), put_f16(dst + 32 + 2 * row, src + 2);
    const uint8_t *s = src + 4, *qs = src + 16;
    for (int j = 0; j < 8; ++j) {  // 32-block j: nibble half j % 2 of bytes 32 (j / 2) ..
      for (int e = 0; e < 32; ++e) codes[e] = (qs[32 * (j / 2) + e] >> (4 * (j % 2))) & 15;
      uint8_t* blk = dst + 64 + j * 288;
      place_nibbles(codes, row, blk);
      k_scale_min_codes(s, j, blk + 256 + row, blk + 272 + row);
    }
  }
}

#if PL_VNNI
// Q4_0 / Q4_1 / Q8_0: one unit of all 16 rows at once, each lane word gathered from its row (`row0`: the group's
// first row at this unit; rows `stride` bytes apart).
template <int64_t base>
void pack_unit16(const uint8_t* row0, int64_t stride, uint8_t* dst) {
  const __m512i at = _mm512_mullo_epi32(_mm512_set1_epi32(static_cast<int>(stride)),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  auto words = [&](int64_t offset) { return _mm512_i32gather_epi32(at, row0 + offset, 1); };
  auto store = [](uint8_t* p, __m512i v) { _mm512_storeu_si512(p, v); };
  auto store_f16 = [](uint8_t* p, __m512i v) {  // the low half of each word
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v));
  };
  if constexpr (base == kQ8_0) {
    for (int s = 0; s < 8; ++s) store(dst + 64 * s, _mm512_xor_si512(words(2 + 4 * s), _mm512_set1_epi8(-128)));
    store_f16(dst + 512, words(0));
  } else {
    const int64_t codes = base == kQ4_0 ? 2 : 4;
    for (int j = 0; j < 4; ++j) store(dst + 64 * j, words(codes + 4 * j));
    const __m512i dm = words(0);
    store_f16(dst + 256, dm);
    if constexpr (base == kQ4_1) store_f16(dst + 288, _mm512_srli_epi32(dm, 16));
  }
}
#endif

template <int64_t base>
void pack_groups(const uint8_t* src, uint8_t* dst, int64_t N, int64_t K) {
  constexpr PackedType pt = packed_type(base);
  const int64_t units = K / pt.unit, src_row = quant_row_bytes(base, K), src_unit = src_row / units;
  const int64_t dst_row = units * pt.row_bytes, dst_unit = kGroupRows * pt.row_bytes;
  at::parallel_for(0, N / kGroupRows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* rows = src + g * kGroupRows * src_row;
      uint8_t* group = dst + g * kGroupRows * dst_row;
#if PL_VNNI
      if constexpr (base != kQ4_K) {
        for (int64_t u = 0; u < units; ++u) pack_unit16<base>(rows + u * src_unit, src_row, group + u * dst_unit);
        continue;
      }
#endif
      for (int64_t i = 0; i < kGroupRows; ++i)
        for (int64_t u = 0; u < units; ++u)
          pack_unit<base>(rows + i * src_row + u * src_unit, i, group + u * dst_unit);
    }
  });
}

// ---- reading one row of a group (the portable path and row lookups) -------------------------------------------
// Row i's 32-block at element k of group g: its scale, offset and codes.
struct RowBlock {
  float ws, wo;
  const uint8_t* codes;
};

RowBlock row_block(int64_t base, const uint8_t* g, int64_t i, int64_t k) {
  const PackedType pt = packed_type(base);
  const uint8_t* p = g + k / pt.unit * kGroupRows * pt.row_bytes;
  if (base == kQ4_K) {
    const uint8_t* blk = p + 64 + (k % 256) / 32 * 288;
    return {f16_at(p + 2 * i) * static_cast<float>(blk[256 + i]),
            0.f - f16_at(p + 32 + 2 * i) * static_cast<float>(blk[272 + i]), blk};
  }
  const int64_t cb = code_bytes(pt.four_bit);
  const float ws = f16_at(p + cb + 2 * i);
  return {ws, base == kQ4_1 ? f16_at(p + cb + 32 + 2 * i) : ws * (base == kQ4_0 ? -8.f : -128.f), p};
}

// Element e (0..31) of row i in a block's codes.
inline int code_at(bool four_bit, const uint8_t* codes, int64_t i, int e) {
  if (!four_bit) return codes[lane_byte(e, i)];
  const uint8_t byte = codes[lane_byte(e % 16, i)];
  return e < 16 ? byte & 15 : byte >> 4;
}

// ---- activations ----------------------------------------------------------------------------------------------
struct Acts {
  int64_t K = 0;
  std::unique_ptr<int8_t[]> a;   // [M, K]
  std::unique_ptr<float[]> d, ds;  // [M, K / 32]: scale, scale x sum of codes
};

// One 32-block: codes round(v * 127 / amax) (half to even), returns their sum; *d = amax / 127.
inline int quantize_block(const float* v, int8_t* a, float* d) {
#if PL_VNNI
  const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a + 16), _mm512_cvtsepi32_epi8(q1));
  *d = amax / 127.f;
  return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int i = 0; i < 32; ++i) {
    const int q = static_cast<int>(std::nearbyint(v[i] * inv));  // the default rounding: half to even
    a[i] = static_cast<int8_t>(q);
    sum += q;
  }
  *d = amax / 127.f;
  return sum;
#endif
}

void quantize_acts(const void* x, bool x_f32, int64_t M, int64_t K, Acts& acts) {
  acts.K = K;
  acts.a.reset(new int8_t[M * K]);
  acts.d.reset(new float[M * K / 32]);
  acts.ds.reset(new float[M * K / 32]);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    float v[32];
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = 0; k < K; k += 32) {
        const int64_t at = m * K + k;
        const float* block = x_f32 ? static_cast<const float*>(x) + at : v;
        if (!x_f32)
          for (int i = 0; i < 32; ++i) v[i] = bf16_to_f32(static_cast<const uint16_t*>(x)[at + i]);
        float d;
        const int sum = quantize_block(block, acts.a.get() + at, &d);
        acts.d[at / 32] = d, acts.ds[at / 32] = d * static_cast<float>(sum);
      }
  });
}

// ---- one group of 16 weight rows against MR activation rows: acc[j] lane i = out[m0 + j, 16 g + i] ------------
#if PL_VNNI
inline __m512 f16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <bool four_bit, int MR>
inline void block(const uint8_t* codes, __m512 ws, __m512 wo, const Acts& A, int64_t m0, int64_t k, __m512* acc) {
  __m512i c[8];
  if constexpr (four_bit) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(codes + 64 * j);
      c[j] = _mm512_and_si512(v, low4), c[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
  } else {
    for (int s = 0; s < 8; ++s) c[s] = _mm512_loadu_si512(codes + 64 * s);
  }
  // unrolled, so that acc[] stays in registers (a loop over j kept the accumulators on the stack: a store and a
  // reload in every row's chain, which halved the GEMM's rate)
#pragma GCC unroll 8
  for (int j = 0; j < MR; ++j) {
    const int8_t* a = A.a.get() + (m0 + j) * A.K + k;
    __m512i part[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // two chains: dpbusd's latency
    for (int s = 0; s < 8; ++s) {
      int32_t four;
      std::memcpy(&four, a + 4 * s, 4);
      part[s % 2] = _mm512_dpbusd_epi32(part[s % 2], c[s], _mm512_set1_epi32(four));
    }
    const __m512i isum = _mm512_add_epi32(part[0], part[1]);
    const int64_t b = ((m0 + j) * A.K + k) / 32;
    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ws, _mm512_set1_ps(A.d[b])), acc[j]);
    acc[j] = _mm512_fmadd_ps(wo, _mm512_set1_ps(A.ds[b]), acc[j]);
  }
}

template <int64_t base, int MR>
void group_tile(const uint8_t* g, const Acts& A, int64_t m0, __m512* acc) {
  constexpr PackedType pt = packed_type(base);
#pragma GCC unroll 8
  for (int j = 0; j < MR; ++j) acc[j] = _mm512_setzero_ps();
  constexpr int64_t unit_bytes = kGroupRows * pt.row_bytes;
  for (int64_t k = 0; k < A.K; k += pt.unit) {
    const uint8_t* p = g + k / pt.unit * unit_bytes;
    // the weights stream from memory once per call: ask for the next units ahead of the hardware prefetcher
    for (int64_t l = 0; l < unit_bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + l), _MM_HINT_T0);
    if constexpr (base == kQ4_K) {
      const __m512 d = f16x16(p), dmin = f16x16(p + 32);
      for (int j = 0; j < 8; ++j) {
        const uint8_t* blk = p + 64 + j * 288;
        const __m512 ws = _mm512_mul_ps(d, u8x16(blk + 256));
        const __m512 wo = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, u8x16(blk + 272)));
        block<true, MR>(blk, ws, wo, A, m0, k + 32 * j, acc);
      }
    } else {
      constexpr int64_t cb = code_bytes(pt.four_bit);
      const __m512 ws = f16x16(p + cb);
      const __m512 wo = base == kQ4_1 ? f16x16(p + cb + 32)
                                      : _mm512_mul_ps(ws, _mm512_set1_ps(base == kQ4_0 ? -8.f : -128.f));
      block<pt.four_bit, MR>(p, ws, wo, A, m0, k, acc);
    }
  }
}

template <int MR>
void store_tile(const __m512* acc, void* out, bool out_f32, int64_t ldo, int64_t m0, int64_t n0) {
  for (int j = 0; j < MR; ++j) {
    const int64_t at = (m0 + j) * ldo + n0;
    if (out_f32) {
      _mm512_storeu_ps(static_cast<float*>(out) + at, acc[j]);
    } else {
      alignas(64) float v[16];
      _mm512_store_ps(v, acc[j]);
      for (int i = 0; i < 16; ++i) static_cast<uint16_t*>(out)[at + i] = f32_to_bf16(v[i]);
    }
  }
}

template <int64_t base, int MR>
void tile(const uint8_t* g, const Acts& A, int64_t m0, void* out, bool out_f32, int64_t ldo, int64_t n0) {
  __m512 acc[MR];
  group_tile<base, MR>(g, A, m0, acc);
  store_tile<MR>(acc, out, out_f32, ldo, m0, n0);
}
#else
// The same arithmetic one output at a time.
template <int64_t base, int MR>
void tile(const uint8_t* g, const Acts& A, int64_t m0, void* out, bool out_f32, int64_t ldo, int64_t n0) {
  constexpr bool four_bit = packed_type(base).four_bit;
  for (int j = 0; j < MR; ++j)
    for (int i = 0; i < kGroupRows; ++i) {
      float acc = 0.f;
      for (int64_t k = 0; k < A.K; k += 32) {
        const RowBlock rb = row_block(base, g, i, k);
        const int8_t* a = A.a.get() + (m0 + j) * A.K + k;
        int32_t isum = 0;
        for (int e = 0; e < 32; ++e) isum += code_at(four_bit, rb.codes, i, e) * a[e];
        const int64_t b = ((m0 + j) * A.K + k) / 32;
        acc = std::fma(static_cast<float>(isum), rb.ws * A.d[b], acc);
        acc = std::fma(rb.wo, A.ds[b], acc);
      }
      const int64_t at = (m0 + j) * ldo + n0 + i;
      if (out_f32)
        static_cast<float*>(out)[at] = acc;
      else
        static_cast<uint16_t*>(out)[at] = f32_to_bf16(acc);
    }
}
#endif

template <int64_t base>
void gemm(const Acts& A, const uint8_t* w, void* out, bool out_f32, int64_t M, int64_t N, int64_t ldo) {
  constexpr PackedType pt = packed_type(base);
  const int64_t group_bytes = kGroupRows * (A.K / pt.unit) * pt.row_bytes;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, group_bytes * std::min<int64_t>(M, 4)));
  at::parallel_for(0, N / kGroupRows, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* gw = w + g * group_bytes;
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) tile<base, 8>(gw, A, m, out, out_f32, ldo, g * kGroupRows);
      switch (M - m) {  // the rest in one tile: the group's codes unpacked once (a verification of k drafts: k + 1)
        case 7: tile<base, 7>(gw, A, m, out, out_f32, ldo, g * kGroupRows); break;
        case 6: tile<base, 6>(gw, A, m, out, out_f32, ldo, g * kGroupRows); break;
        case 5: tile<base, 5>(gw, A, m, out, out_f32, ldo, g * kGroupRows); break;
        case 4: tile<base, 4>(gw, A, m, out, out_f32, ldo, g * kGroupRows); break;
        case 3: tile<base, 3>(gw, A, m, out, out_f32, ldo, g * kGroupRows); break;
        case 2: tile<base, 2>(gw, A, m, out, out_f32, ldo, g * kGroupRows); break;
        case 1: tile<base, 1>(gw, A, m, out, out_f32, ldo, g * kGroupRows); break;
      }
    }
  });
}

}  // namespace

bool packable(int64_t base, int64_t N, int64_t K) {
  const PackedType pt = packed_type(base);
  return pt.unit != 0 && N % kGroupRows == 0 && K % pt.unit == 0;
}

int64_t packed_row_bytes(int64_t base, int64_t K) {
  const PackedType pt = packed_type(base);
  return pt.unit && K % pt.unit == 0 ? K / pt.unit * pt.row_bytes : 0;
}

void quant_gemm_packed(const void* x, bool x_f32, const uint8_t* w, int64_t base, void* out, bool out_f32,
                       int64_t M, int64_t N, int64_t K, int64_t ldo) {
  TORCH_CHECK(packable(base, N, K), "quant_gemm: packed type ", base, " with N ", N, ", K ", K, " is not packable");
  if (M == 0) return;
  Acts acts;
  quantize_acts(x, x_f32, M, K, acts);
  switch (base) {
    case kQ4_0: return gemm<kQ4_0>(acts, w, out, out_f32, M, N, ldo);
    case kQ4_1: return gemm<kQ4_1>(acts, w, out, out_f32, M, N, ldo);
    case kQ8_0: return gemm<kQ8_0>(acts, w, out, out_f32, M, N, ldo);
    case kQ4_K: return gemm<kQ4_K>(acts, w, out, out_f32, M, N, ldo);
  }
}

}  // namespace pagedllm

namespace {

// parts: uint8 [N_i, file row bytes] matrices of ggml type `qtype` -> their packed forms stacked in one matrix,
// uint8 [sum N_i, packed row bytes] (fused q|k|v, gate|up are packed straight into one buffer).
at::Tensor quant_pack(const std::vector<at::Tensor>& parts, int64_t qtype, int64_t K) {
  using namespace pagedllm;
  const int64_t src_row = quant_row_bytes(qtype, K), dst_row = packed_row_bytes(qtype, K);
  int64_t rows = 0;
  for (const at::Tensor& w : parts) {
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) == src_row &&
                    packable(qtype, w.size(0), K), "quant_pack: type ", qtype, " [", w.size(0), ", ", K,
                "] cannot be packed");
    rows += w.size(0);
  }
  TORCH_CHECK(!parts.empty(), "quant_pack: no matrices");
  at::Tensor out = at::empty({rows, dst_row}, parts[0].options());
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (const at::Tensor& w : parts) {
    const uint8_t* src = w.data_ptr<uint8_t>();
    const int64_t N = w.size(0);
    switch (qtype) {
      case kQ4_0: pack_groups<kQ4_0>(src, dst, N, K); break;
      case kQ4_1: pack_groups<kQ4_1>(src, dst, N, K); break;
      case kQ8_0: pack_groups<kQ8_0>(src, dst, N, K); break;
      case kQ4_K: pack_groups<kQ4_K>(src, dst, N, K); break;
    }
    dst += N * dst_row;
  }
  return out;
}

// Rows `ids` of a packed matrix (type kPackedBase + base) dequantized to fp32 [len(ids), K] (embedding lookups,
// tests): exactly the file's values (ws * code + wo is exact in fp32 for these types).
at::Tensor quant_packed_rows(const at::Tensor& w, int64_t qtype, int64_t K, const at::Tensor& ids) {
  using namespace pagedllm;
  const int64_t base = qtype - kPackedBase;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
                  w.size(1) == packed_row_bytes(base, K) && packable(base, w.size(0), K),
              "quant_packed_rows: not a packed matrix of type ", qtype);
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  at::Tensor out = at::empty({idx.numel(), K}, w.options().dtype(at::kFloat));
  const bool four_bit = packed_type(base).four_bit;
  for (int64_t r = 0; r < idx.numel(); ++r) {
    const int64_t n = idx.data_ptr<int64_t>()[r];
    TORCH_CHECK(n >= 0 && n < w.size(0), "quant_packed_rows: row ", n, " out of range");
    const uint8_t* g = w.data_ptr<uint8_t>() + n / kGroupRows * kGroupRows * w.size(1);
    float* o = out.data_ptr<float>() + r * K;
    for (int64_t k = 0; k < K; k += 32) {
      const RowBlock rb = row_block(base, g, n % kGroupRows, k);
      for (int e = 0; e < 32; ++e) o[k + e] = rb.ws * static_cast<float>(code_at(four_bit, rb.codes, n % kGroupRows, e)) + rb.wo;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("quant_pack", &quant_pack);
  m.def("quant_packed_rows", &quant_packed_rows);
}
