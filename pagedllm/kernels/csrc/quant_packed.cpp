// Quantized linears on GGUF weights repacked once at load: 16 weight rows interleaved per group, one row per
// fp32 lane, so that the int8 dot (AVX-512 VNNI vpdpbusd, u8 codes x s8 activations) sums each row in its own
// lane and no horizontal reduction is ever needed (llama.cpp's "x16" repacks follow the same idea). Every type of
// quant_types.h has this form; its layout is derived from the type's traits (Packed<T> below).
//
// A packed matrix keeps the file's bits, regrouped (the same bytes per row, or a few % more where the file packs
// 6-bit scales): group g = rows 16g..16g+15, in units of one file block (32 or 256 elements), each unit of the
// group contiguous:
//   [head fields, each 16 rows contiguous] then per 32 elements [codes][per-32 fields, each 16 rows contiguous]
// codes of a 32-element block, for 16 rows: a 4-bit plane of 4 vectors of 64 bytes, vector j lane i = row i's
// bytes 4j..4j+3 (low nibbles: elements 4j..4j+3, high nibbles: 16 + 4j..), then
//   k5: 8 masks of 64 bits, mask s bit 4i + b = the fifth bit of row i's element 4s + b;
//   k6: 2 vectors of 64 bytes, vector v lane i byte b bits 2t, 2t + 1 = the top bits of element 4(4v + t) + b;
//   k8: instead of the plane, 8 vectors (vector s lane i = row i's elements 4s..4s+3 as u8).
//
// Activations: each row quantized to int8 per 32 elements (scale da = amax / 127, round half to even), with the
// sum of its codes per 32 and per 16 (sa, sa_h) and dsa = da * sa. out[m, n] = sum over blocks, in order, of
// (isum: the exact int32 dot of operands and codes)
//   a float offset wo (kHasMin): acc = fma(float(isum), ws * da, acc); acc = fma(wo, dsa, acc)
//   a fixed zero (the rest):     acc = fma(float(isum - kZero * sa), ws * da, acc)
//   one scale per 16 (Q6_K):     t = float(isum_0 - kZero * sa_0) * ws_0; t = fma(float(isum_1 - ...), ws_1, t);
//                                acc = fma(t, da, acc)
// (the zero is taken off in integers, exactly: one fma a block fewer than an offset in floats).
// The VNNI and the portable path compute exactly this, per output, whatever M is: batch-invariant and equal (a test
// holds the two builds to the same bits).

#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "common.h"
#include "quant_gemm.h"
#include "quant_types.h"

namespace pagedllm {
namespace {

constexpr int64_t kGroupRows = 16;
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead of the dot the weight stream is prefetched
constexpr int64_t kRowChunk = 128;  // activation rows per pass over the weights (a multiple of the 8-row tile)

// The packed layout of type T (bytes for one unit of a 16-row group).
template <class T>
struct Packed {
  static constexpr int kNumPer32 = sizeof(T::kPer32) / sizeof(Field);
  static constexpr int64_t kBlocks = T::kBlock / 32;
  static constexpr int64_t kCodeBytes = T::kCodes == Codes::k8 ? 512 : T::kCodes == Codes::k5 ? 320
                                        : T::kCodes == Codes::k6 ? 384 : 256;
  static constexpr int64_t head_offset(int f) {
    int64_t at = 0;
    for (int i = 0; i < f; ++i) at += kGroupRows * field_bytes(T::kHead[i]);
    return at;
  }
  static constexpr int64_t per32_offset(int f) {  // within a 32-block, after its codes
    int64_t at = kCodeBytes;
    for (int i = 0; i < f; ++i) at += kGroupRows * field_bytes(T::kPer32[i]);
    return at;
  }
  static constexpr int64_t kHeadBytes = head_offset(T::kNumHead);
  static constexpr int64_t kBlockBytes = per32_offset(kNumPer32);
  static constexpr int64_t kUnitBytes = kHeadBytes + kBlocks * kBlockBytes;
  static constexpr int64_t kRowBytes = kUnitBytes / kGroupRows;  // per unit
  static_assert(kUnitBytes % kGroupRows == 0);
};

// Where byte c (0..15 of the 4-bit plane, 0..31 of k8 codes) of row `row` sits: vector c / 4, lane row, byte c % 4.
constexpr int64_t lane_byte(int64_t c, int64_t row) { return (c / 4) * 64 + row * 4 + c % 4; }

// ---- packing ------------------------------------------------------------------------------------------------
template <Codes C>
void place_codes(const uint8_t* codes, int64_t row, uint8_t* blk) {
  if constexpr (C == Codes::k8) {
    for (int s = 0; s < 8; ++s) std::memcpy(blk + 64 * s + 4 * row, codes + 4 * s, 4);
    return;
  } else {
    uint8_t plane[16];
    for (int e = 0; e < 16; e += 8)
      store_u64(plane + e, (load_u64(codes + e) & kLowNibbles) | (load_u64(codes + e + 16) & kLowNibbles) << 4);
    for (int j = 0; j < 4; ++j) std::memcpy(blk + 64 * j + 4 * row, plane + 4 * j, 4);
    if constexpr (C == Codes::k5) {
      uint32_t fifth = 0;  // bit e: element e's
      for (int e = 0; e < 32; e += 8) fifth |= gather_bits(load_u64(codes + e) >> 4) << e;
      for (int s = 0; s < 8; ++s)  // the group's unit was zeroed first
        blk[256 + 8 * s + row / 2] |= ((fifth >> (4 * s)) & 15) << (4 * (row % 2));
    } else if constexpr (C == Codes::k6) {
      for (int v = 0; v < 2; ++v) {
        uint8_t top[4] = {0, 0, 0, 0};
        for (int t = 0; t < 4; ++t)
          for (int b = 0; b < 4; ++b) top[b] |= ((codes[4 * (4 * v + t) + b] >> 4) & 3) << (2 * t);
        std::memcpy(blk + 256 + 64 * v + 4 * row, top, 4);
      }
    }
  }
}

inline void put_field(Field f, uint8_t* at, int64_t row, uint16_t v) {
  if (f == Field::kF16)
    std::memcpy(at + 2 * row, &v, 2);
  else
    at[row] = static_cast<uint8_t>(v);
}

// Row `row`'s file block at src into its lanes of a packed unit.
template <class T>
void pack_unit(const uint8_t* src, int64_t row, uint8_t* dst) {
  using P = Packed<T>;
  uint8_t codes[T::kBlock];
  uint16_t head[T::kNumHead + 1], per32[P::kBlocks * P::kNumPer32];
  T::decode(src, codes, head, per32);
  for (int f = 0; f < T::kNumHead; ++f) put_field(T::kHead[f], dst + P::head_offset(f), row, head[f]);
  for (int64_t b = 0; b < P::kBlocks; ++b) {
    uint8_t* blk = dst + P::kHeadBytes + b * P::kBlockBytes;
    place_codes<T::kCodes>(codes + 32 * b, row, blk);
    for (int f = 0; f < P::kNumPer32; ++f) put_field(T::kPer32[f], blk + P::per32_offset(f), row, per32[b * P::kNumPer32 + f]);
  }
}

template <class T>
void pack_groups(const uint8_t* src, uint8_t* dst, int64_t N, int64_t K) {
  using P = Packed<T>;
  const int64_t units = K / T::kBlock, src_row = units * T::kBytes, dst_row = units * P::kRowBytes;
  at::parallel_for(0, N / kGroupRows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* rows = src + g * kGroupRows * src_row;
      uint8_t* group = dst + g * kGroupRows * dst_row;
      std::memset(group, 0, kGroupRows * dst_row);
      for (int64_t i = 0; i < kGroupRows; ++i)
        for (int64_t u = 0; u < units; ++u) pack_unit<T>(rows + i * src_row + u * T::kBytes, i, group + u * P::kUnitBytes);
    }
  });
}

// ---- reading one row of a group (the portable path and row lookups) -------------------------------------------
// Row i's stored code of element e (0..31) in a 32-block's codes.
template <Codes C>
inline int code_at(const uint8_t* blk, int64_t i, int e) {
  if constexpr (C == Codes::k8) return blk[lane_byte(e, i)];
  const uint8_t byte = blk[lane_byte(e % 16, i)];
  int q = e < 16 ? byte & 15 : byte >> 4;
  if constexpr (C == Codes::k5) q |= ((blk[256 + 8 * (e / 4) + i / 2] >> (4 * (i % 2) + e % 4)) & 1) << 4;
  if constexpr (C == Codes::k6) q |= ((blk[256 + 64 * (e / 16) + 4 * i + e % 4] >> (2 * ((e / 4) % 4))) & 3) << 4;
  return q;
}

inline int32_t field_int(Field f, const uint8_t* at, int64_t i) {  // a byte field
  return f == Field::kU8 ? at[i] : static_cast<int8_t>(at[i]);
}

inline float field_at(Field f, const uint8_t* at, int64_t i) {
  switch (f) {
    case Field::kF16: return f16_at(at + 2 * i);
    case Field::kU8: return static_cast<float>(at[i]);
    default: return static_cast<float>(static_cast<int8_t>(at[i]));
  }
}

// Row i's scales and offsets of the 32-block at element k of group g (ws[h], wo[h] for each half h).
template <class T>
void row_scales(const uint8_t* g, int64_t i, int64_t k, float* ws, float* wo) {
  using P = Packed<T>;
  const uint8_t* unit = g + k / T::kBlock * P::kUnitBytes;
  const uint8_t* blk = unit + P::kHeadBytes + (k % T::kBlock) / 32 * P::kBlockBytes;
  float head[T::kNumHead + 1], f[P::kNumPer32];
  for (int j = 0; j < T::kNumHead; ++j) head[j] = field_at(T::kHead[j], unit + P::head_offset(j), i);
  for (int j = 0; j < P::kNumPer32; ++j) f[j] = field_at(T::kPer32[j], blk + P::per32_offset(j), i);
  T::template scales<float>(head, f, ws, wo);
}

template <class T>
const uint8_t* row_codes(const uint8_t* g, int64_t k) {
  using P = Packed<T>;
  return g + k / T::kBlock * P::kUnitBytes + P::kHeadBytes + (k % T::kBlock) / 32 * P::kBlockBytes;
}

// ---- activations ----------------------------------------------------------------------------------------------
struct Acts {
  int64_t K = 0, block = 32;  // block: elements per activation scale (32, or 256 for the 256-element types)
  std::unique_ptr<int8_t[]> a;   // [M, K]
  std::unique_ptr<float[]> d;    // [M, K / block]: scale
  std::unique_ptr<float[]> ds;   // [M, K / 32]: scale x sum of codes (block 32)
  std::unique_ptr<int32_t[]> s32;  // [M, K / 32]: sum of codes
  std::unique_ptr<int32_t[]> s16;  // [M, K / 16]: sum of the codes of each 16
};

// The largest |v[i]| of n (a multiple of 32) values.
inline float amax_of(const float* v, int64_t n) {
#if PL_VNNI
  __m512 m = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
  return _mm512_reduce_max_ps(m);
#else
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(v[i]));
  return amax;
#endif
}

// One 32-block's codes round(v * inv) (half to even); sums[h] = the sum of codes 16h..16h+15.
inline void quantize32(const float* v, float inv, int8_t* a, int* sums) {
#if PL_VNNI
  const __m512 s = _mm512_set1_ps(inv);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v), s));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 16), s));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a + 16), _mm512_cvtsepi32_epi8(q1));
  sums[0] = _mm512_reduce_add_epi32(q0), sums[1] = _mm512_reduce_add_epi32(q1);
#else
  sums[0] = sums[1] = 0;
  for (int i = 0; i < 32; ++i) {
    const int q = static_cast<int>(std::nearbyint(v[i] * inv));  // the default rounding: half to even
    a[i] = static_cast<int8_t>(q);
    sums[i / 16] += q;
  }
#endif
}

// Each row of x to int8 codes with one scale per `block` elements (da = amax / 127, codes round(v * 127 / amax)):
// per 32 for the 32-element types (llama.cpp's q8_0), per 256 for the 256-element ones (its q8_K), whose per-32
// weight scales are then applied in integers.
void quantize_acts(const void* x, bool x_f32, int64_t M, int64_t K, int64_t block, Acts& acts) {
  acts.K = K, acts.block = block;
  acts.a.reset(new int8_t[M * K]);
  acts.d.reset(new float[M * K / block]);
  acts.ds.reset(new float[M * K / 32]);
  acts.s32.reset(new int32_t[M * K / 32]);
  acts.s16.reset(new int32_t[M * K / 16]);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::unique_ptr<float[]> v(new float[block]);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = 0; k < K; k += block) {
        const int64_t at = m * K + k;
        const float* vals = x_f32 ? static_cast<const float*>(x) + at : v.get();
        if (!x_f32)
          for (int64_t i = 0; i < block; ++i) v[i] = bf16_to_f32(static_cast<const uint16_t*>(x)[at + i]);
        const float amax = amax_of(vals, block), d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        acts.d[at / block] = d;
        for (int64_t e = 0; e < block; e += 32) {
          int sums[2];
          quantize32(vals + e, inv, acts.a.get() + at + e, sums);
          const int64_t b = (at + e) / 32;
          acts.ds[b] = d * static_cast<float>(sums[0] + sums[1]);
          acts.s32[b] = sums[0] + sums[1], acts.s16[2 * b] = sums[0], acts.s16[2 * b + 1] = sums[1];
        }
      }
  });
}

// ---- one group of 16 weight rows against MR activation rows: acc[j] lane i = out[m0 + j, 16 g + i] ------------
#if PL_VNNI
inline __m512 field16(Field f, const uint8_t* p) {
  switch (f) {
    case Field::kF16: return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    case Field::kU8: return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    default: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
}

// The 8 code vectors of a 32-block (vector s lane i: row i's dot operands of elements 4s..4s+3).
template <Codes C>
inline void load_codes(const uint8_t* blk, __m512i* c) {
  if constexpr (C == Codes::k8) {
    for (int s = 0; s < 8; ++s) c[s] = _mm512_loadu_si512(blk + 64 * s);
    return;
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(blk + 64 * j);
      c[j] = _mm512_and_si512(v, low4), c[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    if constexpr (C == Codes::k5) {
      const __m512i bit4 = _mm512_set1_epi8(16);
      for (int s = 0; s < 8; ++s) {
        uint64_t m;
        std::memcpy(&m, blk + 256 + 8 * s, 8);
        c[s] = _mm512_mask_add_epi8(c[s], _cvtu64_mask64(m), c[s], bit4);  // codes < 16: + 16 sets bit 4
      }
    } else if constexpr (C == Codes::k6) {
      const __m512i bits45 = _mm512_set1_epi8(0x30);
      for (int v = 0; v < 2; ++v) {
        const __m512i top = _mm512_loadu_si512(blk + 256 + 64 * v);
        const __m512i at4[4] = {_mm512_slli_epi16(top, 4), _mm512_slli_epi16(top, 2), top, _mm512_srli_epi16(top, 2)};
        // c | (at4 & 0x30): bits 2t, 2t + 1 of each byte moved to bits 4, 5
        for (int t = 0; t < 4; ++t) c[4 * v + t] = _mm512_ternarylogic_epi32(c[4 * v + t], at4[t], bits45, 0xF8);
      }
    } else if constexpr (C == Codes::kNL4) {
      alignas(16) int8_t lut[16];
      for (int i = 0; i < 16; ++i) lut[i] = static_cast<int8_t>(operand<C>(i));
      const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(lut)));
      for (int s = 0; s < 8; ++s) c[s] = _mm512_shuffle_epi8(table, c[s]);
    }
  }
}

// acc plus a 32-block's exact integer dot isum (activation block b) times the block's scale, plus its offset term
// (the 32-element types).
template <class T>
inline __m512 scale_block(__m512i isum, __m512 ws, __m512 wo, const Acts& A, int64_t b, __m512 acc) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ws, _mm512_set1_ps(A.d[b])), acc);
  if constexpr (T::kHasMin) acc = _mm512_fmadd_ps(wo, _mm512_set1_ps(A.ds[b]), acc);
  return acc;
}

// The exact integer dots of one 32-block against MR activation rows, each handed to fold(j, h, isum) as soon as it
// is done: row j's dot over half h (or h = 0: the whole block), less kZero times those codes' sum. Integer sums
// are exact, so how the vpdpbusd are chained changes no result; it is chosen for the latency (5 cycles) of each
// chain. Everything is unrolled, so that the chains stay in registers (a loop over j kept them on the stack: a
// store and a reload in every row's chain, which halved the GEMM's rate).
template <class T, int MR, class Fold>
inline void block_isums(const __m512i* c, const Acts& A, int64_t m0, int64_t k, Fold&& fold) {
  constexpr int H = T::kHalves;
  const int8_t* a[MR];
  int64_t b[MR];
#pragma GCC unroll 8
  for (int j = 0; j < MR; ++j) a[j] = A.a.get() + (m0 + j) * A.K + k, b[j] = ((m0 + j) * A.K + k) / 32;
  // a half's chain starts at -kZero * (its codes' sum): the zero taken off in integers (constants 0 fold away)
  auto start = [&](int j, int h) -> int32_t {
    if constexpr (T::kHasMin) return 0;
    return -T::kZero * (H == 1 ? A.s32[b[j]] : A.s16[2 * b[j] + h]);
  };
  auto dot4 = [&](__m512i chain, int j, int s) {
    int32_t four;
    std::memcpy(&four, a[j] + 4 * s, 4);
    return _mm512_dpbusd_epi32(chain, c[s], _mm512_set1_epi32(four));
  };
  if constexpr (MR > 2) {
    // Many rows: one chain per row and half, the rows interleaved step by step, so that MR independent chains are
    // in flight (two chains per row, a row at a time, left the rows latency-bound; BENCHMARKS.md, issue 29).
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {
      __m512i chain[MR];
#pragma GCC unroll 8
      for (int j = 0; j < MR; ++j) chain[j] = _mm512_set1_epi32(start(j, h));
#pragma GCC unroll 8
      for (int s = h * 8 / H; s < (h + 1) * 8 / H; ++s)
#pragma GCC unroll 8
        for (int j = 0; j < MR; ++j) chain[j] = dot4(chain[j], j, s);
#pragma GCC unroll 8
      for (int j = 0; j < MR; ++j) fold(j, h, chain[j]);
    }
  } else {
    // A few rows (decode): a row at a time, each half of its block in two chains of two (two chains of four left a
    // row latency-bound).
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      __m512i chain[4];
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        chain[q] = _mm512_set1_epi32(q == 0 || (H == 2 && q == 2) ? start(j, q / 2) : 0);
        chain[q] = dot4(dot4(chain[q], j, 2 * q), j, 2 * q + 1);
      }
      const __m512i part[2] = {_mm512_add_epi32(chain[0], chain[1]), _mm512_add_epi32(chain[2], chain[3])};
      if constexpr (H == 1) {
        fold(j, 0, _mm512_add_epi32(part[0], part[1]));
      } else {
        fold(j, 0, part[0]);
        fold(j, 1, part[1]);
      }
    }
  }
}

// A 256-element type's per-32 integer field for 16 rows.
inline __m512i field16i(Field f, const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return f == Field::kU8 ? _mm512_cvtepu8_epi32(v) : _mm512_cvtepi8_epi32(v);
}

// prefetch: whether this tile streams the group from memory (the first of a pass; the later ones find it cached)
template <class T, int MR>
void group_tile(const uint8_t* g, const Acts& A, int64_t m0, __m512* acc, bool prefetch) {
  using P = Packed<T>;
  constexpr int H = T::kHalves;
  constexpr bool kIntScales = T::kBlock == 256;  // quant_types.h: the per-32 scales applied in integers
#pragma GCC unroll 8
  for (int j = 0; j < MR; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < A.K; k += T::kBlock) {
    const uint8_t* p = g + k / T::kBlock * P::kUnitBytes;
    // the weights stream from memory once per pass: ask for the bytes kPrefetchBytes ahead of the hardware
    // prefetcher, a few lines per 32-block (a whole 256-block unit's lines at once stalled the loads behind them)
    for (int64_t l = 0; prefetch && l < P::kHeadBytes; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + l), _MM_HINT_T0);
    // 256-element types: row j's sums of scale x dot (isc) and of min x codes' sum (imn)
    __m512i isc[MR], imn[MR], mins = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) isc[j] = imn[j] = _mm512_setzero_si512();
    for (int64_t b = 0; b < P::kBlocks; ++b) {
      const uint8_t* blk = p + P::kHeadBytes + b * P::kBlockBytes;
      for (int64_t l = 0; prefetch && l < P::kBlockBytes; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + l), _MM_HINT_T0);
      __m512i c[8];
      load_codes<T::kCodes>(blk, c);
      if constexpr (kIntScales) {
        __m512i sc[H];
        for (int h = 0; h < H; ++h) sc[h] = field16i(T::kPer32[h], blk + P::per32_offset(h));
        block_isums<T, MR>(c, A, m0, k + 32 * b, [&](int j, int h, __m512i isum) {
          isc[j] = _mm512_add_epi32(isc[j], _mm512_mullo_epi32(isum, sc[h]));
        });
        if constexpr (T::kHasMin) {
          // the mins of blocks 2i and 2i + 1 as int16 pairs: one vpdpwssd per two blocks and row
          const __m512i mn = field16i(T::kPer32[H], blk + P::per32_offset(H));
          if (b % 2 == 0) {
            mins = mn;
          } else {
            mins = _mm512_or_si512(mins, _mm512_slli_epi32(mn, 16));
#pragma GCC unroll 8
            for (int j = 0; j < MR; ++j) {
              const int32_t* s = A.s32.get() + ((m0 + j) * A.K + k + 32 * b) / 32;
              const int32_t pair = static_cast<int32_t>((static_cast<uint32_t>(s[0]) << 16) | (s[-1] & 0xffff));
              imn[j] = _mm512_dpwssd_epi32(imn[j], mins, _mm512_set1_epi32(pair));
            }
          }
        }
      } else {
        static_assert(H == 1, "the 32-element types have one scale per block");
        __m512 f[P::kNumPer32], ws[1], wo[1];
        for (int i = 0; i < P::kNumPer32; ++i) f[i] = field16(T::kPer32[i], blk + P::per32_offset(i));
        T::template scales<__m512>(nullptr, f, ws, wo);
        block_isums<T, MR>(c, A, m0, k + 32 * b, [&](int j, int, __m512i isum) {
          acc[j] = scale_block<T>(isum, ws[0], wo[0], A, ((m0 + j) * A.K + k + 32 * b) / 32, acc[j]);
        });
      }
    }
    if constexpr (kIntScales) {
      // acc += float(isc) * (d * da) [+ float(imn) * (-dmin * da)]: one activation scale da per 256
      const __m512 d = field16(T::kHead[0], p + P::head_offset(0));
      __m512 neg_dmin = _mm512_setzero_ps();
      if constexpr (T::kHasMin)
        neg_dmin = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(field16(T::kHead[1], p + P::head_offset(1))),
                                                        _mm512_set1_epi32(INT32_MIN)));
#pragma GCC unroll 8
      for (int j = 0; j < MR; ++j) {
        const __m512 da = _mm512_set1_ps(A.d[((m0 + j) * A.K + k) / 256]);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isc[j]), _mm512_mul_ps(d, da), acc[j]);
        if constexpr (T::kHasMin)
          acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imn[j]), _mm512_mul_ps(neg_dmin, da), acc[j]);
      }
    }
  }
}

template <int MR>
void store_tile(const __m512* acc, void* out, bool out_f32, int64_t ldo, int64_t m0, int64_t n0) {
  for (int j = 0; j < MR; ++j) {
    const int64_t at = (m0 + j) * ldo + n0;
    if (out_f32)
      _mm512_storeu_ps(static_cast<float*>(out) + at, acc[j]);
    else
      store_bf16(static_cast<uint16_t*>(out) + at, acc[j]);
  }
}

template <class T, int MR>
void tile(const uint8_t* g, const Acts& A, int64_t m0, void* out, bool out_f32, int64_t ldo, int64_t n0,
          bool prefetch) {
  __m512 acc[MR];
  group_tile<T, MR>(g, A, m0, acc, prefetch);
  store_tile<MR>(acc, out, out_f32, ldo, m0, n0);
}
#else
// The same arithmetic one output at a time.
template <class T, int MR>
void tile(const uint8_t* g, const Acts& A, int64_t m0, void* out, bool out_f32, int64_t ldo, int64_t n0, bool) {
  using P = Packed<T>;
  constexpr int H = T::kHalves;
  for (int j = 0; j < MR; ++j)
    for (int i = 0; i < kGroupRows; ++i) {
      float acc = 0.f;
      int32_t isc = 0, imn = 0;  // 256-element types (see group_tile)
      for (int64_t k = 0; k < A.K; k += 32) {
        const uint8_t* blk = row_codes<T>(g, k);
        const int8_t* a = A.a.get() + (m0 + j) * A.K + k;
        const int64_t b = ((m0 + j) * A.K + k) / 32;
        int32_t part[2] = {0, 0};
        for (int e = 0; e < 32; ++e) part[e / 16] += operand<T::kCodes>(code_at<T::kCodes>(blk, i, e)) * a[e];
        if constexpr (T::kBlock == 256) {
          for (int h = 0; h < H; ++h) {
            const int32_t isum = H == 1 ? part[0] + part[1] - (T::kHasMin ? 0 : T::kZero * A.s32[b])
                                        : part[h] - T::kZero * A.s16[2 * b + h];
            isc += isum * field_int(T::kPer32[h], blk + P::per32_offset(h), i);
          }
          if constexpr (T::kHasMin) imn += field_int(T::kPer32[H], blk + P::per32_offset(H), i) * A.s32[b];
          if ((k + 32) % 256 == 0) {
            const uint8_t* unit = g + k / 256 * P::kUnitBytes;
            const float da = A.d[((m0 + j) * A.K + k) / 256];
            acc = std::fma(static_cast<float>(isc), field_at(T::kHead[0], unit + P::head_offset(0), i) * da, acc);
            if constexpr (T::kHasMin)
              acc = std::fma(static_cast<float>(imn), -field_at(T::kHead[1], unit + P::head_offset(1), i) * da, acc);
            isc = imn = 0;
          }
        } else {
          float ws[1], wo[1];
          row_scales<T>(g, i, k, ws, wo);
          const int32_t isum = part[0] + part[1] - (T::kHasMin ? 0 : T::kZero * A.s32[b]);
          acc = std::fma(static_cast<float>(isum), ws[0] * A.d[b], acc);
          if constexpr (T::kHasMin) acc = std::fma(wo[0], A.ds[b], acc);
        }
      }
      const int64_t at = (m0 + j) * ldo + n0 + i;
      if (out_f32)
        static_cast<float*>(out)[at] = acc;
      else
        static_cast<uint16_t*>(out)[at] = f32_to_bf16(acc);
    }
}
#endif

template <class T>
void gemm(const Acts& A, const uint8_t* w, void* out, bool out_f32, int64_t M, int64_t N, int64_t ldo) {
  const int64_t group_bytes = A.K / T::kBlock * Packed<T>::kUnitBytes;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, group_bytes * std::min<int64_t>(M, 4)));
  at::parallel_for(0, N / kGroupRows, grain, [&](int64_t g0, int64_t g1) {
    // kRowChunk activation rows at a time over this thread's groups: the chunk's int8 rows stay in L2 while every
    // group streams past them (all M rows per group spilled a long prompt's activations out of L2, re-read for
    // each group); the weights are re-read once per chunk instead. Every output's arithmetic is the same.
    for (int64_t mc = 0; mc < M; mc += kRowChunk)
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* gw = w + g * group_bytes;
      const int64_t n0 = g * kGroupRows, m_end = std::min(M, mc + kRowChunk);
      int64_t m = mc;
      for (; m + 8 <= m_end; m += 8) tile<T, 8>(gw, A, m, out, out_f32, ldo, n0, m == mc);
      switch (m_end - m) {  // the rest in one tile: the group's codes unpacked once (a verification of k drafts: k + 1)
        case 7: tile<T, 7>(gw, A, m, out, out_f32, ldo, n0, m == mc); break;
        case 6: tile<T, 6>(gw, A, m, out, out_f32, ldo, n0, m == mc); break;
        case 5: tile<T, 5>(gw, A, m, out, out_f32, ldo, n0, m == mc); break;
        case 4: tile<T, 4>(gw, A, m, out, out_f32, ldo, n0, m == mc); break;
        case 3: tile<T, 3>(gw, A, m, out, out_f32, ldo, n0, m == mc); break;
        case 2: tile<T, 2>(gw, A, m, out, out_f32, ldo, n0, m == mc); break;
        case 1: tile<T, 1>(gw, A, m, out, out_f32, ldo, n0, m == mc); break;
      }
    }
  });
}

}  // namespace

bool packable(int64_t base, int64_t N, int64_t K) {
  int64_t block = 0;
  visit_type(base, [&](auto tag) { block = decltype(tag)::traits::kBlock; });
  return block != 0 && N % kGroupRows == 0 && K % block == 0;
}

int64_t packed_row_bytes(int64_t base, int64_t K) {
  int64_t bytes = 0;
  visit_type(base, [&](auto tag) {
    using T = typename decltype(tag)::traits;
    if (K % T::kBlock == 0) bytes = K / T::kBlock * Packed<T>::kRowBytes;
  });
  return bytes;
}

void quant_gemm_packed(const void* x, bool x_f32, const uint8_t* w, int64_t base, void* out, bool out_f32,
                       int64_t M, int64_t N, int64_t K, int64_t ldo) {
  TORCH_CHECK(packable(base, N, K), "quant_gemm: packed type ", base, " with N ", N, ", K ", K, " is not packable");
  if (M == 0) return;
  visit_type(base, [&](auto tag) {
    using T = typename decltype(tag)::traits;
    Acts acts;
    quantize_acts(x, x_f32, M, K, T::kBlock, acts);
    gemm<T>(acts, w, out, out_f32, M, N, ldo);
  });
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
  at::Tensor out = empty_huge_paged(rows, dst_row);  // streamed whole every decode step
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (const at::Tensor& w : parts) {
    const int64_t N = w.size(0);
    visit_type(qtype, [&](auto tag) { pack_groups<typename decltype(tag)::traits>(w.data_ptr<uint8_t>(), dst, N, K); });
    dst += N * dst_row;
  }
  return out;
}

// Rows `ids` of a packed matrix (type kPackedBase + base) dequantized to fp32 [len(ids), K] (embedding lookups,
// tests): exactly the file's values.
at::Tensor quant_packed_rows(const at::Tensor& w, int64_t qtype, int64_t K, const at::Tensor& ids) {
  using namespace pagedllm;
  const int64_t base = qtype - kPackedBase;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
                  w.size(1) == packed_row_bytes(base, K) && packable(base, w.size(0), K),
              "quant_packed_rows: not a packed matrix of type ", qtype);
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  at::Tensor out = at::empty({idx.numel(), K}, w.options().dtype(at::kFloat));
  visit_type(base, [&](auto tag) {
    using T = typename decltype(tag)::traits;
    for (int64_t r = 0; r < idx.numel(); ++r) {
      const int64_t n = idx.data_ptr<int64_t>()[r], i = n % kGroupRows;
      TORCH_CHECK(n >= 0 && n < w.size(0), "quant_packed_rows: row ", n, " out of range");
      const uint8_t* g = w.data_ptr<uint8_t>() + n / kGroupRows * kGroupRows * w.size(1);
      float* o = out.data_ptr<float>() + r * K;
      for (int64_t k = 0; k < K; k += 32) {
        float ws[T::kHalves], wo[T::kHalves];
        row_scales<T>(g, i, k, ws, wo);
        const uint8_t* blk = row_codes<T>(g, k);
        for (int e = 0; e < 32; ++e) {
          const int h = T::kHalves == 1 ? 0 : e / 16;
          // one rounding of ws * (operand - offset), as the file's dequantization rounds it
          o[k + e] = std::fma(ws[h], static_cast<float>(operand<T::kCodes>(code_at<T::kCodes>(blk, i, e))), wo[h]);
        }
      }
    }
  });
  return out;
}

// The C++ side of the type table, for the test that holds pagedllm/quantization/types.py equal to it: int64
// [types, 4] rows of (ggml id, block elements, block bytes, packed bytes per row and block).
at::Tensor quant_type_table() {
  using namespace pagedllm;
  std::vector<int64_t> rows;
  for_each_type([&](auto tag) {
    using T = typename decltype(tag)::traits;
    rows.insert(rows.end(), {decltype(tag)::value, T::kBlock, T::kBytes, Packed<T>::kRowBytes});
  });
  const int64_t n = static_cast<int64_t>(rows.size()) / 4;
  return at::tensor(rows, at::kLong).view({n, 4}).clone();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("quant_type_table", &quant_type_table);
  m.def("quant_pack", &quant_pack);
  m.def("quant_packed_rows", &quant_packed_rows);
}
