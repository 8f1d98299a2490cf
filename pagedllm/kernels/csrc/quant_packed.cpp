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
//   k8: instead of the plane, 8 vectors (vector s lane i = row i's elements 4s..4s+3 as u8);
//   k3: instead of the plane, 2 vectors of 64 bytes laid out as k6's top bits (the low two bits), then 8 masks of
//       64 bits laid out as k5's (the third bit);
//   k2: the 2 vectors of k3 alone.
//
// Activations: each row quantized to int8 per 32 elements (scale da = amax / 127, round half to even), with the
// sum of its codes per 32 and per 16 (sa, sa_h) and dsa = da * sa. out[m, n] = sum over blocks, in order, of
// (isum: the exact int32 dot of operands and codes)
//   a float offset wo (kHasMin): acc = fma(float(isum), ws * da, acc); acc = fma(wo, dsa, acc)
//   a fixed zero (the rest):     acc = fma(float(isum - kZero * sa), ws * da, acc)
//   one scale per 16 (Q2_K, Q3_K, Q6_K): t = float(isum_0 - kZero * sa_0) * ws_0;
//                                t = fma(float(isum_1 - kZero * sa_1), ws_1, t);
//                                (kHasMin: t = fma(wo_0, float(sa_0), t); t = fma(wo_1, float(sa_1), t);)
//                                acc = fma(t, da, acc)
// (the zero is taken off in integers, exactly: one fma a block fewer than an offset in floats).
// The VNNI, the AVX2 and the portable path compute exactly this, per output, whatever M is: batch-invariant and
// equal (a test holds each build to the portable one's bits).

#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cpuid.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <vector>

#include "common.h"
#include "quant_gemm.h"
#include "quant_types.h"

namespace pagedllm {
namespace {

constexpr int64_t kGroupRows = 16;
// How far ahead of the dot the weight stream is prefetched, into L2 (_MM_HINT_T1): far enough that each core keeps
// enough DRAM requests in flight to stream near the read bandwidth; a short distance into L1 left the one-row
// product waiting on memory (BENCHMARKS.md, Bounds: decode).
constexpr int64_t kPrefetchBytes = 32768;
constexpr int64_t kRowChunk = 128;  // activation rows per pass over the weights (a multiple of the 8-row tile)
constexpr int64_t kTileRows = 16;  // the AMX path takes whole tiles of 16 activation rows (amx_tile below)

std::atomic<bool> matrix_engine_on{true};  // set_matrix_engine: off runs the VNNI path alone (benches, tests)

bool amx_enabled() { return PL_AMX && matrix_engine_on.load(std::memory_order_relaxed) && amx_usable(); }

// Loads this thread's tile configuration for one parallel claim and releases the tile state after it (a thread
// that keeps tile state makes every context switch save 8 KB more).
struct AmxScope {
  AmxScope(bool on, int halves);
  ~AmxScope();
  bool on;
};

// The packed layout of type T (bytes for one unit of a 16-row group).
template <class T>
struct Packed {
  static constexpr int kNumPer32 = sizeof(T::kPer32) / sizeof(Field);
  static constexpr int64_t kBlocks = T::kBlock / 32;
  static constexpr int64_t kCodeBytes = T::kCodes == Codes::k8 ? 512 : T::kCodes == Codes::k5 ? 320
                                        : T::kCodes == Codes::k6 ? 384 : T::kCodes == Codes::k3 ? 192
                                        : T::kCodes == Codes::k2 ? 128 : 256;
  static constexpr int64_t head_offset(int f) {
    int64_t at = 0;
    for (int i = 0; i < f; ++i) at += kGroupRows * field_bytes(T::kHead[i]);
    return at;
  }
  static constexpr int64_t per32_offset(int f) {  // within a 32-block, after its codes
    if (f < kNumPer32 && T::kPer32[f] == Field::kHi4) return per32_offset(f - 1);  // the kLo4 field's bytes
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
// Bit `bit` of a 32-block's codes into 8 masks of 64 bits at `at`: mask s bit 4 row + b = element 4s + b's. The
// group's unit was zeroed first.
inline void place_bit_plane(const uint8_t* codes, int bit, int64_t row, uint8_t* at) {
  uint32_t plane = 0;  // bit e: element e's
  for (int e = 0; e < 32; e += 8) plane |= gather_bits(load_u64(codes + e) >> bit) << e;
  for (int s = 0; s < 8; ++s) at[8 * s + row / 2] |= ((plane >> (4 * s)) & 15) << (4 * (row % 2));
}

// Bits `bit`, `bit` + 1 of a 32-block's codes into 2 vectors of 64 bytes at `at`: vector v lane `row` byte b bits
// 2t, 2t + 1 = element 4(4v + t) + b's.
inline void place_bit_pairs(const uint8_t* codes, int bit, int64_t row, uint8_t* at) {
  for (int v = 0; v < 2; ++v) {
    uint32_t pairs = 0;  // byte b of each word: element 4(4v + t) + b
    for (int t = 0; t < 4; ++t) {
      uint32_t word;
      std::memcpy(&word, codes + 4 * (4 * v + t), 4);
      pairs |= ((word >> bit) & 0x03030303u) << (2 * t);
    }
    std::memcpy(at + 64 * v + 4 * row, &pairs, 4);
  }
}

template <Codes C>
void place_codes(const uint8_t* codes, int64_t row, uint8_t* blk) {
  if constexpr (C == Codes::k8) {
    for (int s = 0; s < 8; ++s) std::memcpy(blk + 64 * s + 4 * row, codes + 4 * s, 4);
    return;
  } else if constexpr (C == Codes::k2 || C == Codes::k3) {
    place_bit_pairs(codes, 0, row, blk);
    if constexpr (C == Codes::k3) place_bit_plane(codes, 2, row, blk + 128);
  } else {
    uint8_t plane[16];
    for (int e = 0; e < 16; e += 8)
      store_u64(plane + e, (load_u64(codes + e) & kLowNibbles) | (load_u64(codes + e + 16) & kLowNibbles) << 4);
    for (int j = 0; j < 4; ++j) std::memcpy(blk + 64 * j + 4 * row, plane + 4 * j, 4);
    if constexpr (C == Codes::k5) place_bit_plane(codes, 4, row, blk + 256);
    if constexpr (C == Codes::k6) place_bit_pairs(codes, 4, row, blk + 256);
  }
}

inline void put_field(Field f, uint8_t* at, int64_t row, uint16_t v) {
  if (f == Field::kF16)
    std::memcpy(at + 2 * row, &v, 2);
  else if (f == Field::kLo4 || f == Field::kHi4)  // the unit was zeroed first
    at[row] |= static_cast<uint8_t>((v & 15) << (f == Field::kHi4 ? 4 : 0));
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
// Row i's bit of element e in place_bit_plane's masks at `at`, and its two bits in place_bit_pairs' vectors.
inline int plane_bit_at(const uint8_t* at, int64_t i, int e) {
  return (at[8 * (e / 4) + i / 2] >> (4 * (i % 2) + e % 4)) & 1;
}

inline int bit_pair_at(const uint8_t* at, int64_t i, int e) {
  return (at[64 * (e / 16) + 4 * i + e % 4] >> (2 * ((e / 4) % 4))) & 3;
}

// Row i's stored code of element e (0..31) in a 32-block's codes.
template <Codes C>
inline int code_at(const uint8_t* blk, int64_t i, int e) {
  if constexpr (C == Codes::k8) return blk[lane_byte(e, i)];
  if constexpr (C == Codes::k2) return bit_pair_at(blk, i, e);
  if constexpr (C == Codes::k3) return bit_pair_at(blk, i, e) | plane_bit_at(blk + 128, i, e) << 2;
  const uint8_t byte = blk[lane_byte(e % 16, i)];
  int q = e < 16 ? byte & 15 : byte >> 4;
  if constexpr (C == Codes::k5) q |= plane_bit_at(blk + 256, i, e) << 4;
  if constexpr (C == Codes::k6) q |= bit_pair_at(blk + 256, i, e) << 4;
  return q;
}

inline float field_at(Field f, const uint8_t* at, int64_t i) {
  switch (f) {
    case Field::kF16: return f16_at(at + 2 * i);
    case Field::kU8: return static_cast<float>(at[i]);
    case Field::kLo4: return static_cast<float>(at[i] & 15);
    case Field::kHi4: return static_cast<float>(at[i] >> 4);
    case Field::kE8M0Half: return e8m0_half(at[i]);
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
  int64_t K = 0, capacity = 0;  // capacity: elements of `a`
  std::unique_ptr<int8_t[]> a;   // [M, K]
  std::unique_ptr<float[]> d, ds;  // [M, K / 32]: scale, scale x sum of codes
  std::unique_ptr<int32_t[]> s32;  // [M, K / 32]: sum of codes
  std::unique_ptr<int32_t[]> s16;  // [M, K / 16]: sum of the codes of each 16
  // Row m's codes from element k, and the index of its 32-block there into d, ds and s32.
  const int8_t* codes(int64_t m, int64_t k) const { return a.get() + m * K + k; }
  int64_t block(int64_t m, int64_t k) const { return (m * K + k) / 32; }
};

// One 32-block: codes round(v * 127 / amax) (half to even); sums[h] = the sum of codes 16h..16h+15; *d = amax / 127.
#if PL_VNNI
inline void quantize_block(__m512 v0, __m512 v1, int8_t* a, float* d, int* sums) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a + 16), _mm512_cvtsepi32_epi8(q1));
  *d = amax / 127.f;
  sums[0] = _mm512_reduce_add_epi32(q0), sums[1] = _mm512_reduce_add_epi32(q1);
}

// x's 32 elements at `at` (fp32 or bf16) quantized.
inline void quantize_block_at(const void* x, bool x_f32, int64_t at, int8_t* a, float* d, int* sums) {
  if (x_f32) {
    const float* v = static_cast<const float*>(x) + at;
    quantize_block(_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16), a, d, sums);
  } else {
    const uint16_t* v = static_cast<const uint16_t*>(x) + at;
    quantize_block(load_bf16(v), load_bf16(v + 16), a, d, sums);
  }
}
#elif PL_INT8_AVX2
// The same operations on 8 lanes (a decode's matrices of long rows spend a tenth of their call here in scalar code).
inline __m256 load8(const void* x, bool x_f32, int64_t at) {
  if (x_f32) return _mm256_loadu_ps(static_cast<const float*>(x) + at);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + at));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

inline void quantize_block_at(const void* x, bool x_f32, int64_t at, int8_t* a, float* d, int* sums) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = load8(x, x_f32, at + 8 * i);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                           _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // half to even, as nearbyint
  // |q| <= 127: the saturating packs are exact; packs interleave 128-bit lanes, the permute restores the order
  const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
  const __m256i q16b = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
  const __m256i q8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(q16, q16b), 0xd8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), q8);
  *d = amax / 127.f;
  sums[0] = hsum8(_mm256_add_epi32(q[0], q[1])), sums[1] = hsum8(_mm256_add_epi32(q[2], q[3]));
}
#else
inline void quantize_block_at(const void* x, bool x_f32, int64_t at, int8_t* a, float* d, int* sums) {
  float v[32];
  for (int i = 0; i < 32; ++i)
    v[i] = x_f32 ? static_cast<const float*>(x)[at + i] : bf16_to_f32(static_cast<const uint16_t*>(x)[at + i]);
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  sums[0] = sums[1] = 0;
  for (int i = 0; i < 32; ++i) {
    const int q = static_cast<int>(std::nearbyint(v[i] * inv));  // the default rounding: half to even
    a[i] = static_cast<int8_t>(q);
    sums[i / 16] += q;
  }
  *d = amax / 127.f;
}
#endif

constexpr int64_t kKeptActBytes = 1 << 20;  // activation codes up to this size (and their scales) are kept per thread

void quantize_acts(const void* x, bool x_f32, int64_t M, int64_t K, Acts& acts) {
  // A decode step makes ~100 of these calls on one row each; reusing the buffers saves a malloc and free of each.
  if (M * K > acts.capacity || acts.capacity > kKeptActBytes) {  // a larger buffer is not kept past its next call
    acts.capacity = M * K;
    acts.a.reset(new int8_t[M * K]);
    acts.d.reset(new float[M * K / 32]);
    acts.ds.reset(new float[M * K / 32]);
    acts.s32.reset(new int32_t[M * K / 32]);
    acts.s16.reset(new int32_t[M * K / 16]);
  }
  acts.K = K;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = 0; k < K; k += 32) {
        const int64_t at = m * K + k;
        float d;
        int sums[2];
        quantize_block_at(x, x_f32, at, acts.a.get() + at, &d, sums);
        acts.d[at / 32] = d, acts.ds[at / 32] = d * static_cast<float>(sums[0] + sums[1]);
        acts.s32[at / 32] = sums[0] + sums[1], acts.s16[at / 16] = sums[0], acts.s16[at / 16 + 1] = sums[1];
      }
  });
}

// ---- one group of 16 weight rows against MR activation rows: acc[j] lane i = out[m0 + j, 16 g + i] ------------
#if PL_VNNI
inline __m512 field16(Field f, const uint8_t* p) {
  switch (f) {
    case Field::kF16: return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    case Field::kU8: return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    case Field::kLo4:
    case Field::kHi4: {
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm512_cvtepi32_ps(f == Field::kLo4 ? _mm512_and_si512(bytes, _mm512_set1_epi32(15))
                                                 : _mm512_srli_epi32(bytes, 4));
    }
    case Field::kE8M0Half: {  // e8m0_half: (e - 1) << 23, or a subnormal 0x00200000 << e below e = 2
      const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
      const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
      return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal,
                                                         subnormal));
    }
    default: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
}

// c[s] + `value` (a bit above the codes in c) in the bytes whose bit is set in mask s of the 8 at `at`
// (place_bit_plane's layout).
inline void add_bit_plane(const uint8_t* at, int value, __m512i* c) {
  const __m512i v = _mm512_set1_epi8(static_cast<char>(value));
  for (int s = 0; s < 8; ++s) {
    uint64_t m;
    std::memcpy(&m, at + 8 * s, 8);
    c[s] = _mm512_mask_add_epi8(c[s], _cvtu64_mask64(m), c[s], v);
  }
}

// The 8 code vectors of a 32-block (vector s lane i: row i's dot operands of elements 4s..4s+3).
template <Codes C>
inline void load_codes(const uint8_t* blk, __m512i* c) {
  if constexpr (C == Codes::k8) {
    for (int s = 0; s < 8; ++s) c[s] = _mm512_loadu_si512(blk + 64 * s);
    return;
  } else if constexpr (C == Codes::k2 || C == Codes::k3) {
    const __m512i low2 = _mm512_set1_epi8(3);
    for (int v = 0; v < 2; ++v) {  // bits 2t, 2t + 1 of each byte to bits 0, 1 of code vector 4v + t
      const __m512i pairs = _mm512_loadu_si512(blk + 64 * v);
      c[4 * v] = _mm512_and_si512(pairs, low2);
      for (int t = 1; t < 4; ++t) c[4 * v + t] = _mm512_and_si512(_mm512_srli_epi16(pairs, 2 * t), low2);
    }
    if constexpr (C == Codes::k3) add_bit_plane(blk + 128, 4, c);  // codes < 4: + 4 sets bit 2
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(blk + 64 * j);
      c[j] = _mm512_and_si512(v, low4), c[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    if constexpr (C == Codes::k5) {
      add_bit_plane(blk + 256, 16, c);  // codes < 16: + 16 sets bit 4
    } else if constexpr (C == Codes::k6) {
      const __m512i bits45 = _mm512_set1_epi8(0x30);
      for (int v = 0; v < 2; ++v) {
        const __m512i top = _mm512_loadu_si512(blk + 256 + 64 * v);
        const __m512i at4[4] = {_mm512_slli_epi16(top, 4), _mm512_slli_epi16(top, 2), top, _mm512_srli_epi16(top, 2)};
        // c | (at4 & 0x30): bits 2t, 2t + 1 of each byte moved to bits 4, 5
        for (int t = 0; t < 4; ++t) c[4 * v + t] = _mm512_ternarylogic_epi32(c[4 * v + t], at4[t], bits45, 0xF8);
      }
    } else if constexpr (kTableCodes<C>) {
      alignas(16) int8_t lut[16];
      for (int i = 0; i < 16; ++i) lut[i] = static_cast<int8_t>(operand<C>(i));
      const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(lut)));
      for (int s = 0; s < 8; ++s) c[s] = _mm512_shuffle_epi8(table, c[s]);
    }
  }
}

// acc plus a 32-block's exact integer dot isum (activation block b) times the block's scale, plus its offset term
// (types with one scale per 32; the two per 32 of Q3_K and Q6_K are applied in block_dots).
template <class T>
inline __m512 scale_block(__m512i isum, __m512 ws, __m512 wo, const Acts& A, int64_t b, __m512 acc) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ws, _mm512_set1_ps(A.d[b])), acc);
  if constexpr (T::kHasMin) acc = _mm512_fmadd_ps(wo, _mm512_set1_ps(A.ds[b]), acc);
  return acc;
}

// acc plus a 32-block's halves (types with a scale per 16): t, the halves' integer dots times their scales, plus
// (kHasMin) each half's offset times its activation codes' sum, all times the activation scale.
template <class T>
inline __m512 scale_halves(__m512 t, const __m512* wo, const Acts& A, int64_t b, __m512 acc) {
  if constexpr (T::kHasMin) {
    t = _mm512_fmadd_ps(wo[0], _mm512_set1_ps(static_cast<float>(A.s16[2 * b])), t);
    t = _mm512_fmadd_ps(wo[1], _mm512_set1_ps(static_cast<float>(A.s16[2 * b + 1])), t);
  }
  return _mm512_fmadd_ps(t, _mm512_set1_ps(A.d[b]), acc);
}

// Steps s0..s1 - 1 of a 32-block's dots against MR activation rows (step s: codes c[s], the rows' bytes 4s..4s+3),
// the rows interleaved step by step so that MR independent chains are in flight.
template <int MR>
inline void interleaved_steps(__m512i* chain, const int8_t* const* a, const __m512i* c, int s0, int s1) {
#pragma GCC unroll 8
  for (int s = s0; s < s1; ++s)
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      int32_t four;
      std::memcpy(&four, a[j] + 4 * s, 4);
      chain[j] = _mm512_dpbusd_epi32(chain[j], c[s], _mm512_set1_epi32(four));
    }
}

// The dots of one 32-block against MR activation rows, folded into acc by the block's scales. Integer sums are
// exact, so how the vpdpbusd are chained changes no result; it is chosen for the latency (5 cycles) of each chain.
template <class T, int MR>
inline void block_dots(const __m512i* c, const __m512* ws, const __m512* wo, const Acts& A, int64_t m0, int64_t k,
                       __m512* acc) {
  // everything unrolled, so that the accumulators and chains stay in registers (a loop over j kept them on the
  // stack: a store and a reload in every row's chain, which halved the GEMM's rate)
  if constexpr (T::kHalves == 1 && MR > 2) {
    // Many rows, one scale per block: one chain per row over the whole block, the rows interleaved step by step, so
    // that MR independent chains are in flight (two chains per row, a row at a time, left the rows latency-bound;
    // BENCHMARKS.md, issue 29). A fixed zero starts the chain at -kZero * (codes' sum).
    __m512i chain[MR];
    const int8_t* a[MR];
    int64_t b[MR];
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      a[j] = A.codes(m0 + j, k);
      b[j] = A.block(m0 + j, k);
      chain[j] = _mm512_set1_epi32(T::kHasMin ? 0 : -T::kZero * A.s32[b[j]]);
    }
    interleaved_steps<MR>(chain, a, c, 0, 8);
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) acc[j] = scale_block<T>(chain[j], ws[0], wo[0], A, b[j], acc[j]);
  } else if constexpr (T::kHalves == 2 && MR > 2) {
    // Many rows, a scale per 16 (Q2_K, Q3_K, Q6_K): the same, one chain per row and half; the first half's scaled
    // sum waits in t while the second half's chains run.
    const int8_t* a[MR];
    int64_t b[MR];
    __m512 t[MR];
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) a[j] = A.codes(m0 + j, k), b[j] = A.block(m0 + j, k);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m512i chain[MR];
#pragma GCC unroll 8
      for (int j = 0; j < MR; ++j) chain[j] = _mm512_set1_epi32(-T::kZero * A.s16[2 * b[j] + h]);
      interleaved_steps<MR>(chain, a, c, 4 * h, 4 * h + 4);
#pragma GCC unroll 8
      for (int j = 0; j < MR; ++j) {
        if (h == 0) {
          t[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(chain[j]), ws[0]);
        } else {
          acc[j] = scale_halves<T>(_mm512_fmadd_ps(_mm512_cvtepi32_ps(chain[j]), ws[1], t[j]), wo, A, b[j], acc[j]);
        }
      }
    }
  } else {
    // A few rows (decode): a row at a time, each half of its block in two chains of two (two chains of four left a
    // row latency-bound).
    // A fixed zero starts each half's first chain at -kZero * (its codes' sum).
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      const int8_t* a = A.codes(m0 + j, k);
      const int64_t b = A.block(m0 + j, k);
      int32_t start[2] = {0, 0};  // each half's first chain starts here (constants 0 fold away)
      if constexpr (!T::kHasMin && T::kHalves == 1) start[0] = -T::kZero * A.s32[b];
      if constexpr (!T::kHasMin && T::kHalves == 2)
        start[0] = -T::kZero * A.s16[2 * b], start[1] = -T::kZero * A.s16[2 * b + 1];
      __m512i chain[4];
      for (int q = 0; q < 4; ++q) {
        chain[q] = q % 2 == 0 ? _mm512_set1_epi32(start[q / 2]) : _mm512_setzero_si512();
        for (int s = 2 * q; s < 2 * q + 2; ++s) {
          int32_t four;
          std::memcpy(&four, a + 4 * s, 4);
          chain[q] = _mm512_dpbusd_epi32(chain[q], c[s], _mm512_set1_epi32(four));
        }
      }
      const __m512i part[2] = {_mm512_add_epi32(chain[0], chain[1]), _mm512_add_epi32(chain[2], chain[3])};
      if constexpr (T::kHalves == 1) {
        acc[j] = scale_block<T>(_mm512_add_epi32(part[0], part[1]), ws[0], wo[0], A, b, acc[j]);
      } else {
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[1]), ws[1],
                                         _mm512_mul_ps(_mm512_cvtepi32_ps(part[0]), ws[0]));
        acc[j] = scale_halves<T>(t, wo, A, b, acc[j]);
      }
    }
  }
}

// prefetch: whether this tile streams the group from memory (the first of a pass; the later ones find it cached)
template <class T, int MR>
void group_tile(const uint8_t* g, const Acts& A, int64_t m0, __m512* acc, bool prefetch) {
  using P = Packed<T>;
#pragma GCC unroll 8
  for (int j = 0; j < MR; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < A.K; k += T::kBlock) {
    const uint8_t* p = g + k / T::kBlock * P::kUnitBytes;
    // the weights stream from memory once per pass: ask for the bytes kPrefetchBytes ahead of the hardware
    // prefetcher, a few lines per 32-block (a whole 256-block unit's lines at once stalled the loads behind them)
    for (int64_t l = 0; prefetch && l < P::kHeadBytes; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + l), _MM_HINT_T1);
    __m512 head[T::kNumHead + 1];
    for (int f = 0; f < T::kNumHead; ++f) head[f] = field16(T::kHead[f], p + P::head_offset(f));
    for (int64_t b = 0; b < P::kBlocks; ++b) {
      const uint8_t* blk = p + P::kHeadBytes + b * P::kBlockBytes;
      for (int64_t l = 0; prefetch && l < P::kBlockBytes; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + l), _MM_HINT_T1);
      __m512 f[P::kNumPer32], ws[T::kHalves], wo[T::kHalves];
      for (int i = 0; i < P::kNumPer32; ++i) f[i] = field16(T::kPer32[i], blk + P::per32_offset(i));
      T::template scales<__m512>(head, f, ws, wo);
      __m512i c[8];
      load_codes<T::kCodes>(blk, c);
      block_dots<T, MR>(c, ws, wo, A, m0, k + 32 * b, acc);
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

#if PL_AMX
// ---- AMX: 16 activation rows x 16 weight rows per tile product ------------------------------------------------
// The tile unit's tdpbssd gives each 32-block's dots (16 x 16 at once) as exact int32 sums, the same integers as
// the vpdpbusd chains, and they are scaled by the same float operations in the same order: a row's output is
// bitwise the VNNI path's, whatever M is. It takes whole 16-row tiles of a chunk; the rest run as before.
// oneDNN's batch-reduce GEMM (torch's cpublas::brgemm) sums over K in one call, which these formats cannot use: each
// 32-block has its own weight and activation scales, so the integer sums leave the tiles block by block, and the
// tile stores and the float work on the sums (not the tile products) bound this path (BENCHMARKS.md, Bounds).

// Tiles, one scale per 32 (kHalves 1): sums 0 and 1, activations 2 and 4 (16 rows x 32 bytes), operands 3 and 5
// (8 quads of 16 columns): two blocks in flight. A scale per 16: sums 0, 1 and 2, 3 (the halves of two blocks),
// activations 4, 5 (16 x 16 bytes), operands 6, 7 (4 quads).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int halves) {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
    if (halves == 1) {
      colsb[2] = colsb[4] = 32, rows[3] = rows[5] = 8;
    } else {
      colsb[4] = colsb[5] = 16, rows[6] = rows[7] = 4;
    }
  }
};

// A group's 32-blocks unpacked once per chunk of rows, for all of the chunk's tiles: per block its 8 operand
// vectors (the tile's quads: vector s lane i = row i's operands of elements 4s..4s+3) less the type's fixed zero
// (so that the tile's sums are isum - kZero x (codes' sum), the integer the VNNI chains start from; operand - kZero
// fits a signed byte for every type), and its scales and offsets.
struct Panel {
  struct Block {
    __m512i codes[8];
    __m512 ws[2], wo[2];
  };
  int64_t capacity = 0;
  std::unique_ptr<Block[]> blocks;  // [K / 32]
  void reserve(int64_t n) {
    if (n > capacity) capacity = n, blocks.reset(new Block[n]);
  }
};

template <class T>
void unpack_panel(const uint8_t* g, int64_t K, Panel& panel) {
  using P = Packed<T>;
  panel.reserve(K / 32);
  const __m512i zero = _mm512_set1_epi8(static_cast<char>(T::kZero));
  for (int64_t k = 0; k < K; k += T::kBlock) {
    const uint8_t* p = g + k / T::kBlock * P::kUnitBytes;
    __m512 head[T::kNumHead + 1];
    for (int f = 0; f < T::kNumHead; ++f) head[f] = field16(T::kHead[f], p + P::head_offset(f));
    for (int64_t b = 0; b < P::kBlocks; ++b) {
      const uint8_t* blk = p + P::kHeadBytes + b * P::kBlockBytes;
      __m512 f[P::kNumPer32 + 1], ws[2], wo[2];
      for (int i = 0; i < P::kNumPer32; ++i) f[i] = field16(T::kPer32[i], blk + P::per32_offset(i));
      T::template scales<__m512>(head, f, ws, wo);
      Panel::Block& out = panel.blocks[k / 32 + b];
      for (int h = 0; h < T::kHalves; ++h) out.ws[h] = ws[h], out.wo[h] = wo[h];
      load_codes<T::kCodes>(blk, out.codes);
      if constexpr (T::kZero != 0)
        for (int s = 0; s < 8; ++s) out.codes[s] = _mm512_sub_epi8(out.codes[s], zero);
    }
  }
}

// Sums of 16 rows x 16 columns for each block (one scale per 32) or half (a scale per 16), in flight two blocks at
// a time: block k's products are issued (into tile set `set`, stored to sums[0], and sums[1] for the second half)
// before block k - 32's are scaled. (Tile numbers are immediates in the instructions, hence one branch per set.)
template <class T>
inline void issue_block(const Panel::Block& blk, const int8_t* a, int64_t lda, int set, int32_t (*sums)[256]) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(blk.codes);
  if constexpr (T::kHalves == 1) {
    if (set == 0) {
      _tile_zero(0); _tile_loadd(2, a, lda); _tile_loadd(3, b, 64); _tile_dpbssd(0, 2, 3);
      _tile_stored(0, sums[0], 64);
    } else {
      _tile_zero(1); _tile_loadd(4, a, lda); _tile_loadd(5, b, 64); _tile_dpbssd(1, 4, 5);
      _tile_stored(1, sums[0], 64);
    }
  } else {
    _tile_loadd(4, a, lda); _tile_loadd(5, a + 16, lda); _tile_loadd(6, b, 64); _tile_loadd(7, b + 256, 64);
    if (set == 0) {
      _tile_zero(0); _tile_zero(1); _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 5, 7);
      _tile_stored(0, sums[0], 64); _tile_stored(1, sums[1], 64);
    } else {
      _tile_zero(2); _tile_zero(3); _tile_dpbssd(2, 4, 6); _tile_dpbssd(3, 5, 7);
      _tile_stored(2, sums[0], 64); _tile_stored(3, sums[1], 64);
    }
  }
}

// Rows m0..m0 + 15 against a group unpacked in `blocks`: acc[j] (row m0 + j) plus each block's sums, scaled as
// block_dots' many-row paths scale them.
template <class T>
void amx_tile(const Panel::Block* blocks, const Acts& A, int64_t m0, void* out, bool out_f32, int64_t ldo,
              int64_t n0) {
  alignas(64) int32_t sums[4][kTileRows * kTileRows];
  int32_t (*set_sums[2])[256] = {sums, sums + T::kHalves};
  const int64_t K = A.K, row_blocks = K / 32;
  __m512 acc[kTileRows];
#pragma GCC unroll 16
  for (int j = 0; j < kTileRows; ++j) acc[j] = _mm512_setzero_ps();
  issue_block<T>(blocks[0], A.codes(m0, 0), K, 0, set_sums[0]);
  for (int64_t i = 0; i < row_blocks; ++i) {
    const int set = static_cast<int>(i % 2);
    if (i + 1 < row_blocks) issue_block<T>(blocks[i + 1], A.codes(m0, 32 * (i + 1)), K, 1 - set, set_sums[1 - set]);
    const int32_t(*s)[256] = set_sums[set];
    const Panel::Block& blk = blocks[i];
    const int64_t b0 = A.block(m0, 32 * i);  // row m0 + j's activation block: b0 + j * row_blocks
#pragma GCC unroll 16
    for (int j = 0; j < kTileRows; ++j) {
      const int64_t b = b0 + j * row_blocks;
      const __m512i s0 = _mm512_load_si512(s[0] + kTileRows * j);
      if constexpr (T::kHalves == 1) {
        acc[j] = scale_block<T>(s0, blk.ws[0], blk.wo[0], A, b, acc[j]);
      } else {
        const __m512i s1 = _mm512_load_si512(s[1] + kTileRows * j);
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s0), blk.ws[0]);
        acc[j] = scale_halves<T>(_mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), blk.ws[1], t), blk.wo, A, b, acc[j]);
      }
    }
  }
  // stored here rather than by store_tile, so that acc's address never escapes: the tile stores clobber memory,
  // and an escaped acc would be kept there, a store and a reload per row and block
#pragma GCC unroll 16
  for (int j = 0; j < kTileRows; ++j) {
    const int64_t at = (m0 + j) * ldo + n0;
    if (out_f32)
      _mm512_storeu_ps(static_cast<float*>(out) + at, acc[j]);
    else
      store_bf16(static_cast<uint16_t*>(out) + at, acc[j]);
  }
}

#endif
#elif PL_INT8_AVX2
// AVX2 without VNNI: the same arithmetic, a group as two halves of 8 rows (one __m256 lane per row), the int8 dot as
// vpmaddubsw (u8 x s8, adjacent pairs summed to s16) then vpmaddwd (pairs of s16 to s32). The pair sums are exact
// for operands below 129: every type but Q8_0 and IQ4_NL / IQ4_XS, whose operands (up to 255) are taken as the
// signed operand - 128 against the activations with its signs (|w| <= 128): the same integer as operand x a - 128 x a,
// which the other paths get by starting the chain at -128 x (codes' sum).

constexpr int64_t kHalfRows = 8;

// The 8 rows of half h of a field at p (a field holds 16 rows, 2 bytes each for fp16, else 1).
inline __m256 field8(Field f, const uint8_t* p, int h) {
  p += h * kHalfRows * (f == Field::kF16 ? 2 : 1);
  const __m128i raw = f == Field::kF16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                                       : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  switch (f) {
    case Field::kF16: return _mm256_cvtph_ps(raw);
    case Field::kU8: return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw));
    case Field::kLo4:
    case Field::kHi4: {
      const __m256i bytes = _mm256_cvtepu8_epi32(raw);
      return _mm256_cvtepi32_ps(f == Field::kLo4 ? _mm256_and_si256(bytes, _mm256_set1_epi32(15))
                                                 : _mm256_srli_epi32(bytes, 4));
    }
    case Field::kE8M0Half: {  // e8m0_half: (e - 1) << 23, or a subnormal 0x00200000 << e below e = 2
      const __m256i e = _mm256_cvtepu8_epi32(raw);
      const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
      const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
      return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
    }
    default: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
  }
}

// 0xff in byte j where bit j of m is set.
inline __m256i mask_bytes(uint32_t m) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(m)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// c[s] + `value` in the bytes of half h whose bit is set in mask s of the 8 at `at` (place_bit_plane's layout:
// mask bit 4 row + b; half h holds rows 8h..8h+7, bits 32h..32h+31).
inline void add_bit_plane(const uint8_t* at, int value, int h, __m256i* c) {
  const __m256i v = _mm256_set1_epi8(static_cast<char>(value));
  for (int s = 0; s < 8; ++s) {
    uint64_t m;
    std::memcpy(&m, at + 8 * s, 8);
    c[s] = _mm256_add_epi8(c[s], _mm256_and_si256(mask_bytes(static_cast<uint32_t>(m >> (32 * h))), v));
  }
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The 8 code vectors of half h of a 32-block (vector s lane i: row 8h + i's operands of elements 4s..4s+3).
template <Codes C>
inline void load_codes(const uint8_t* blk, int h, __m256i* c) {
  const int64_t half = 32 * h;
  if constexpr (C == Codes::k8) {
    for (int s = 0; s < 8; ++s) c[s] = load32(blk + 64 * s + half);
    return;
  } else if constexpr (C == Codes::k2 || C == Codes::k3) {
    const __m256i low2 = _mm256_set1_epi8(3);
    for (int v = 0; v < 2; ++v) {  // bits 2t, 2t + 1 of each byte to bits 0, 1 of code vector 4v + t
      const __m256i pairs = load32(blk + 64 * v + half);
      c[4 * v] = _mm256_and_si256(pairs, low2);
      for (int t = 1; t < 4; ++t) c[4 * v + t] = _mm256_and_si256(_mm256_srli_epi16(pairs, 2 * t), low2);
    }
    if constexpr (C == Codes::k3) add_bit_plane(blk + 128, 4, h, c);
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int j = 0; j < 4; ++j) {
      const __m256i v = load32(blk + 64 * j + half);
      c[j] = _mm256_and_si256(v, low4), c[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    if constexpr (C == Codes::k5) {
      add_bit_plane(blk + 256, 16, h, c);
    } else if constexpr (C == Codes::k6) {
      const __m256i bits45 = _mm256_set1_epi8(0x30);
      for (int v = 0; v < 2; ++v) {
        const __m256i top = load32(blk + 256 + 64 * v + half);
        const __m256i at4[4] = {_mm256_slli_epi16(top, 4), _mm256_slli_epi16(top, 2), top,
                                _mm256_srli_epi16(top, 2)};
        for (int t = 0; t < 4; ++t) c[4 * v + t] = _mm256_or_si256(c[4 * v + t], _mm256_and_si256(at4[t], bits45));
      }
    } else if constexpr (kTableCodes<C>) {
      alignas(16) int8_t lut[16];
      for (int i = 0; i < 16; ++i) lut[i] = static_cast<int8_t>(operand<C>(i));
      const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(lut)));
      for (int s = 0; s < 8; ++s) c[s] = _mm256_shuffle_epi8(table, c[s]);
    }
  }
}

// Operands above 127 (Q8_0, IQ4_NL, IQ4_XS; not MXFP4's, at most 24): the dot runs on operand - 128 with its signs
// moved onto the activations.
template <Codes C>
constexpr bool kSignedDot = C == Codes::k8 || C == Codes::kNL4;

// The dots of one 32-block of NH halves (c[h]: load_codes of the half) against MR activation rows, folded into
// acc[h] by the block's scales. A decode row takes both halves at once (NH = 2): each activation broadcast and
// scale serves 16 rows, and the group's bytes are read in one pass.
template <class T, int MR, int NH>
inline void block_dots(const __m256i (&c)[NH][8], const __m256 (&ws)[NH][T::kHalves],
                       const __m256 (&wo)[NH][T::kHalves], const Acts& A, int64_t m0, int64_t k,
                       __m256 (&acc)[NH][MR]) {
  constexpr bool kSigned = kSignedDot<T::kCodes>;
  // vpmaddubsw results summed in 16 bits before widening, as many as stay below 2^15 with activations of |a| <= 127:
  // each is at most 2 x 127 x the largest operand (128 signed, 63 for 6-bit codes, 31 for up to 5 bits, 24 for MXFP4)
  constexpr int kSteps16 = kSigned ? 1 : T::kCodes == Codes::k6 ? 2 : 4;
  __m256i u[NH][8], sign[NH][8];  // the unsigned operands; (kSigned) the signs they were taken from
  for (int h = 0; h < NH; ++h)
    for (int s = 0; s < 8; ++s) {
      if constexpr (kSigned) {
        sign[h][s] = _mm256_xor_si256(c[h][s], _mm256_set1_epi8(static_cast<char>(0x80)));  // operand - 128, signed
        u[h][s] = _mm256_abs_epi8(sign[h][s]);  // -128 becomes 128 as an unsigned byte
      } else {
        u[h][s] = c[h][s];
      }
    }
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
  for (int j = 0; j < MR; ++j) {
    const int8_t* a = A.codes(m0 + j, k);
    const int64_t b = A.block(m0 + j, k);
    __m256i part[NH][2];
    for (int half = 0; half < 2; ++half) {  // elements 16 half .. 16 half + 15
      __m256i chain[NH];
      for (int h = 0; h < NH; ++h) chain[h] = _mm256_setzero_si256();
      for (int s0 = 4 * half; s0 < 4 * half + 4; s0 += kSteps16) {
        __m256i sum16[NH];
        for (int h = 0; h < NH; ++h) sum16[h] = _mm256_setzero_si256();
        for (int s = s0; s < s0 + kSteps16; ++s) {
          int32_t four;
          std::memcpy(&four, a + 4 * s, 4);
          const __m256i av = _mm256_set1_epi32(four);
          for (int h = 0; h < NH; ++h)
            sum16[h] = _mm256_add_epi16(sum16[h], _mm256_maddubs_epi16(u[h][s], kSigned ? _mm256_sign_epi8(av, sign[h][s]) : av));
        }
        for (int h = 0; h < NH; ++h) chain[h] = _mm256_add_epi32(chain[h], _mm256_madd_epi16(sum16[h], ones));
      }
      for (int h = 0; h < NH; ++h) part[h][half] = chain[h];
    }
    const __m256 da = _mm256_set1_ps(A.d[b]);
    for (int h = 0; h < NH; ++h) {
      if constexpr (T::kHalves == 1) {
        __m256i isum = _mm256_add_epi32(part[h][0], part[h][1]);
        if constexpr (!T::kHasMin && !kSigned) isum = _mm256_add_epi32(isum, _mm256_set1_epi32(-T::kZero * A.s32[b]));
        acc[h][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ws[h][0], da), acc[h][j]);
        if constexpr (T::kHasMin) acc[h][j] = _mm256_fmadd_ps(wo[h][0], _mm256_set1_ps(A.ds[b]), acc[h][j]);
      } else {
        const __m256i p0 = _mm256_add_epi32(part[h][0], _mm256_set1_epi32(-T::kZero * A.s16[2 * b]));
        const __m256i p1 = _mm256_add_epi32(part[h][1], _mm256_set1_epi32(-T::kZero * A.s16[2 * b + 1]));
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(p0), ws[h][0]);
        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), ws[h][1], t);
        if constexpr (T::kHasMin) {
          t = _mm256_fmadd_ps(wo[h][0], _mm256_set1_ps(static_cast<float>(A.s16[2 * b])), t);
          t = _mm256_fmadd_ps(wo[h][1], _mm256_set1_ps(static_cast<float>(A.s16[2 * b + 1])), t);
        }
        acc[h][j] = _mm256_fmadd_ps(t, da, acc[h][j]);
      }
    }
  }
}

// Halves h0 .. h0 + NH - 1 of a group (rows 8h..8h+7) against MR activation rows.
template <class T, int MR, int NH>
void halves(const uint8_t* g, const Acts& A, int64_t m0, int h0, void* out, bool out_f32, int64_t ldo, int64_t n0,
            bool prefetch) {
  using P = Packed<T>;
  __m256 acc[NH][MR];
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < MR; ++j) acc[h][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < A.K; k += T::kBlock) {
    const uint8_t* p = g + k / T::kBlock * P::kUnitBytes;
    for (int64_t l = 0; prefetch && l < P::kHeadBytes; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + l), _MM_HINT_T1);
    __m256 head[NH][T::kNumHead + 1];
    for (int h = 0; h < NH; ++h)
      for (int f = 0; f < T::kNumHead; ++f) head[h][f] = field8(T::kHead[f], p + P::head_offset(f), h0 + h);
    for (int64_t b = 0; b < P::kBlocks; ++b) {
      const uint8_t* blk = p + P::kHeadBytes + b * P::kBlockBytes;
      for (int64_t l = 0; prefetch && l < P::kBlockBytes; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + l), _MM_HINT_T1);
      __m256 ws[NH][T::kHalves], wo[NH][T::kHalves];
      __m256i c[NH][8];
      for (int h = 0; h < NH; ++h) {
        __m256 f[P::kNumPer32 + 1];
        for (int i = 0; i < P::kNumPer32; ++i) f[i] = field8(T::kPer32[i], blk + P::per32_offset(i), h0 + h);
        T::template scales<__m256>(head[h], f, ws[h], wo[h]);
        load_codes<T::kCodes>(blk, h0 + h, c[h]);
      }
      block_dots<T, MR, NH>(c, ws, wo, A, m0, k + 32 * b, acc);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < MR; ++j) {
      const int64_t at = (m0 + j) * ldo + n0 + kHalfRows * (h0 + h);
      if (out_f32) {
        _mm256_storeu_ps(static_cast<float*>(out) + at, acc[h][j]);
      } else {
        alignas(32) float v[kHalfRows];
        _mm256_store_ps(v, acc[h][j]);
        for (int i = 0; i < kHalfRows; ++i) static_cast<uint16_t*>(out)[at + i] = f32_to_bf16(v[i]);
      }
    }
}

template <class T, int MR>
void tile(const uint8_t* g, const Acts& A, int64_t m0, void* out, bool out_f32, int64_t ldo, int64_t n0,
          bool prefetch) {
  if constexpr (MR == 1) {
    halves<T, 1, 2>(g, A, m0, 0, out, out_f32, ldo, n0, prefetch);
  } else {  // the second half finds the group's lines cached
    halves<T, MR, 1>(g, A, m0, 0, out, out_f32, ldo, n0, prefetch);
    halves<T, MR, 1>(g, A, m0, 1, out, out_f32, ldo, n0, false);
  }
}
#else
// The same arithmetic one output at a time.
template <class T, int MR>
void tile(const uint8_t* g, const Acts& A, int64_t m0, void* out, bool out_f32, int64_t ldo, int64_t n0, bool) {
  for (int j = 0; j < MR; ++j)
    for (int i = 0; i < kGroupRows; ++i) {
      float acc = 0.f;
      for (int64_t k = 0; k < A.K; k += 32) {
        float ws[T::kHalves], wo[T::kHalves];
        row_scales<T>(g, i, k, ws, wo);
        const uint8_t* blk = row_codes<T>(g, k);
        const int8_t* a = A.codes(m0 + j, k);
        int32_t part[2] = {0, 0};
        for (int e = 0; e < 32; ++e) part[e / 16] += operand<T::kCodes>(code_at<T::kCodes>(blk, i, e)) * a[e];
        const int64_t b = A.block(m0 + j, k);
        if constexpr (T::kHalves == 1) {
          const int32_t isum = part[0] + part[1] - (T::kHasMin ? 0 : T::kZero * A.s32[b]);
          acc = std::fma(static_cast<float>(isum), ws[0] * A.d[b], acc);
          if constexpr (T::kHasMin) acc = std::fma(wo[0], A.ds[b], acc);
        } else {
          const float t0 = static_cast<float>(part[0] - T::kZero * A.s16[2 * b]) * ws[0];
          float t = std::fma(static_cast<float>(part[1] - T::kZero * A.s16[2 * b + 1]), ws[1], t0);
          if constexpr (T::kHasMin) {
            t = std::fma(wo[0], static_cast<float>(A.s16[2 * b]), t);
            t = std::fma(wo[1], static_cast<float>(A.s16[2 * b + 1]), t);
          }
          acc = std::fma(t, A.d[b], acc);
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

AmxScope::AmxScope(bool on, int halves) : on(on) {
#if PL_AMX
  static const TileConfig configs[2] = {TileConfig(1), TileConfig(2)};
  if (on) _tile_loadconfig(&configs[halves - 1]);
#else
  (void)halves;
#endif
}

AmxScope::~AmxScope() {
#if PL_AMX
  if (on) _tile_release();
#endif
}

template <class T>
void gemm(const Acts& A, const uint8_t* w, void* out, bool out_f32, int64_t M, int64_t N, int64_t ldo) {
  const int64_t group_bytes = A.K / T::kBlock * Packed<T>::kUnitBytes;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, group_bytes * std::min<int64_t>(M, 4)));
  const bool amx = M >= kTileRows && amx_enabled();
  parallel_balanced(N / kGroupRows, grain, [&](int64_t g0, int64_t g1) {
    const AmxScope tiles(amx, T::kHalves);  // this thread's tile configuration, for this claim
    // The claim's groups against kRowChunk activation rows at a time: a chunk's int8 rows stay in L2 while the
    // claim's groups pass them (a claim of many rows is a group or two, which stays in cache across the chunks).
    // Every output's arithmetic is the same.
    for (int64_t mc = 0; mc < M; mc += kRowChunk)
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* gw = w + g * group_bytes;
      const int64_t n0 = g * kGroupRows, m_end = std::min(M, mc + kRowChunk);
      int64_t m = mc;
#if PL_AMX
      if (amx && m_end - m >= kTileRows) {
        thread_local Panel panel;
        unpack_panel<T>(gw, A.K, panel);
        asm volatile("" ::: "memory");  // the panel's stores land before the tile loads (asm without a memory input)
        const Panel::Block* blocks = panel.blocks.get();
        for (; m + kTileRows <= m_end; m += kTileRows) amx_tile<T>(blocks, A, m, out, out_f32, ldo, n0);
      }
#endif
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

bool amx_usable() {
#if PL_AMX
  // CPUID.(7, 0).EDX: AMX-TILE (bit 24) and AMX-INT8 (bit 25); Linux hands a process the 8 KB tile state only when
  // asked (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), and refuses where the hypervisor hides it.
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return usable;
#else
  return false;
#endif
}

bool set_matrix_engine(bool on) { return matrix_engine_on.exchange(on); }

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
  thread_local Acts acts;
  quantize_acts(x, x_f32, M, K, acts);
  visit_type(base, [&](auto tag) { gemm<typename decltype(tag)::traits>(acts, w, out, out_f32, M, N, ldo); });
}

}  // namespace pagedllm

namespace {

constexpr int64_t kPackSliceBytes = 16 << 20;  // source bytes packed between two page drops

// MADV_DONTNEED over the whole pages of [p, p + n): pages of a file mapping leave the process (they stay in the page
// cache, and a later read maps them again). Never for anonymous memory, which it would zero.
void drop_file_pages(const uint8_t* p, int64_t n) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE)), at = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = (at + page - 1) / page * page, end = (at + n) / page * page;
  if (end > first) madvise(reinterpret_cast<void*>(first), end - first, MADV_DONTNEED);
}

// parts: uint8 [N_i, file row bytes] matrices of ggml type `qtype` -> their packed forms stacked in one matrix,
// uint8 [sum N_i, packed row bytes] (fused q|k|v, gate|up are packed straight into one buffer).
// parts_are_file_pages: the parts are views of a read-only file mapping; their pages are dropped as the packing
// passes them, so that a large matrix (a 150k-row head) is not resident twice at the peak of a load.
at::Tensor quant_pack(const std::vector<at::Tensor>& parts, int64_t qtype, int64_t K, bool parts_are_file_pages) {
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
  const int64_t slice = std::max<int64_t>(1, kPackSliceBytes / src_row / kGroupRows) * kGroupRows;
  for (const at::Tensor& w : parts) {
    const int64_t N = w.size(0);
    const uint8_t* src = w.data_ptr<uint8_t>();
    for (int64_t r0 = 0; r0 < N; r0 += slice) {
      const int64_t n = std::min(slice, N - r0);
      visit_type(qtype, [&](auto tag) {
        pack_groups<typename decltype(tag)::traits>(src + r0 * src_row, dst + r0 * dst_row, n, K);
      });
      if (parts_are_file_pages) drop_file_pages(src + r0 * src_row, n * src_row);
    }
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
  // off: the packed GEMM runs its VNNI path alone where it would use AMX (the same bits; benches compare the two)
  m.def("set_matrix_engine(bool on) -> bool", [](bool on) { return pagedllm::set_matrix_engine(on); });
}
