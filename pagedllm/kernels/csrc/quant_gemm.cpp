// Quantized GGUF linears (see quant_gemm.h for the scheme): unpack the weight row, dot it with int8 activations.
//
// Layout of the per-call buffers (K rounded up to K64, a multiple of 64, zero padded: padding adds exact zeros):
//   weight row n: q[K64] u8 codes in element order, s16[K64/16], o16[K64/16] fp32 (w = s * q + o)
//   activation row m: a[K64] s8, al[K64/4] fp32 scale per 4 elements (one vpdpbusd lane), ao16[K64/16] fp32
//   (scale x sum of the 16 codes, for the offset term)
// out[m, n] = sum over 64-chunks of cvt(dpbusd(q, a)) * (s_lane * al) in 16 fp32 lanes, reduced in a fixed
// order, plus sum_b o16[b] * ao16[b]. Both the VNNI and the portable path compute exactly these products; only
// their final summation order differs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "quant_gemm.h"


namespace pagedllm {
namespace {

struct TypeInfo {
  int64_t block, bytes;
};

constexpr TypeInfo type_info(int64_t t) {
  switch (t) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {0, 0};
  }
}

// Sub-block j's scale and min of a K-quant super-block with scales at s.
void scale_min_k4(const uint8_t* s, int j, float d, float dmin, float* scale, float* min) {
  uint8_t sc, m;
  k_scale_min_codes(s, j, &sc, &m);
  *scale = d * sc, *min = -dmin * m;
}

// ---- weight unpacking: one 32- or 256-element block into codes q and per-16 scale/offset ----------------------
// The nibble split (low half, high half of 16 bytes) is vectorised where the build has AVX-512; the rest is
// per-block scalar work.
inline void split_nibbles16(const uint8_t* src, uint8_t* lo, uint8_t* hi) {
#if PL_VNNI
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m128i m = _mm_set1_epi8(0x0f);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm_and_si128(v, m));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm_and_si128(_mm_srli_epi16(v, 4), m));
#else
  for (int i = 0; i < 16; ++i) lo[i] = src[i] & 15, hi[i] = src[i] >> 4;
#endif
}

inline void split_nibbles32(const uint8_t* src, uint8_t* lo, uint8_t* hi) {
  split_nibbles16(src, lo, hi);
  split_nibbles16(src + 16, lo + 16, hi + 16);
}

// or (bit `shift` of each of 32 bytes) << 4 into q[0..32)
inline void add_high_bit(const uint8_t* bits, int shift, uint8_t* q) {
#if PL_VNNI
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits));
  const __mmask32 set = _mm256_test_epi8_mask(v, _mm256_set1_epi8(static_cast<char>(1 << shift)));
  const __m256i cur = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_or_si256(cur, _mm256_maskz_mov_epi8(set, _mm256_set1_epi8(16))));
#else
  for (int i = 0; i < 32; ++i) q[i] |= ((bits[i] >> shift) & 1) << 4;
#endif
}

// or (bits shift, shift + 1 of each of 32 bytes) << 4 into q[0..32)
inline void add_two_bits(const uint8_t* bits, int shift, uint8_t* q) {
#if PL_VNNI
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits));
  const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(3)), 4);
  const __m256i cur = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_or_si256(cur, hi));
#else
  for (int i = 0; i < 32; ++i) q[i] |= ((bits[i] >> shift) & 3) << 4;
#endif
}

template <int64_t t>
inline void unpack_block(const uint8_t* b, uint8_t* q, float* s16, float* o16) {
  switch (t) {
    case kQ4_0:
    case kQ4_1: {
      const float d = f16_at(b), o = t == kQ4_0 ? -8.f * d : f16_at(b + 2);
      split_nibbles16(b + (t == kQ4_0 ? 2 : 4), q, q + 16);
      s16[0] = s16[1] = d, o16[0] = o16[1] = o;
      return;
    }
    case kQ5_0: {
      const float d = f16_at(b);
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      split_nibbles16(b + 6, q, q + 16);
      for (int i = 0; i < 32; ++i) q[i] |= ((qh >> i) & 1) << 4;
      s16[0] = s16[1] = d, o16[0] = o16[1] = -16.f * d;
      return;
    }
    case kQ8_0: {
      const float d = f16_at(b);
      for (int i = 0; i < 32; ++i) q[i] = b[2 + i] ^ 0x80;  // s8 + 128 as u8
      s16[0] = s16[1] = d, o16[0] = o16[1] = -128.f * d;
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const float d = f16_at(b), dmin = f16_at(b + 2);
      const uint8_t* qs = b + (t == kQ4_K ? 16 : 48);
      for (int c = 0; c < 4; ++c) {  // 64 elements: low nibbles are sub-block 2c, high nibbles 2c + 1
        uint8_t* qc = q + 64 * c;
        split_nibbles32(qs + 32 * c, qc, qc + 32);
        if (t == kQ5_K) add_high_bit(b + 16, 2 * c, qc), add_high_bit(b + 16, 2 * c + 1, qc + 32);
        for (int h = 0; h < 2; ++h) {
          float sc, mn;
          scale_min_k4(b + 4, 2 * c + h, d, dmin, &sc, &mn);
          s16[4 * c + 2 * h] = s16[4 * c + 2 * h + 1] = sc;  // sub-block 2c + h: 16-blocks 4c + 2h, +1
          o16[4 * c + 2 * h] = o16[4 * c + 2 * h + 1] = mn;
        }
      }
      return;
    }
    case kQ6_K: {
      const float d = f16_at(b + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int h = 0; h < 2; ++h) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        uint8_t* qq = q + 128 * h;
        split_nibbles32(ql, qq, qq + 64);        // elements l and l + 64
        split_nibbles32(ql + 32, qq + 32, qq + 96);  // l + 32 and l + 96
        for (int part = 0; part < 4; ++part) add_two_bits(qh, 2 * part, qq + 32 * part);
      }
      for (int j = 0; j < 16; ++j) s16[j] = d * sc[j], o16[j] = -32.f * d * sc[j];
      return;
    }
  }
}

struct WeightRow {
  std::vector<uint8_t> q;
  std::vector<float> s16, o16;
  void resize(int64_t k64) { q.assign(k64, 0), s16.assign(k64 / 16, 0.f), o16.assign(k64 / 16, 0.f); }
};

template <int64_t t>
void unpack_blocks(const uint8_t* row, int64_t K, WeightRow& w) {
  constexpr TypeInfo ti = type_info(t);
  for (int64_t i = 0, k = 0; k < K; ++i, k += ti.block)
    unpack_block<t>(row + i * ti.bytes, w.q.data() + k, w.s16.data() + k / 16, w.o16.data() + k / 16);
}

void unpack_row(int64_t t, const uint8_t* row, int64_t K, WeightRow& w) {
  switch (t) {
    case kQ4_0: return unpack_blocks<kQ4_0>(row, K, w);
    case kQ4_1: return unpack_blocks<kQ4_1>(row, K, w);
    case kQ5_0: return unpack_blocks<kQ5_0>(row, K, w);
    case kQ8_0: return unpack_blocks<kQ8_0>(row, K, w);
    case kQ4_K: return unpack_blocks<kQ4_K>(row, K, w);
    case kQ5_K: return unpack_blocks<kQ5_K>(row, K, w);
    case kQ6_K: return unpack_blocks<kQ6_K>(row, K, w);
  }
}

// ---- activation quantization ----------------------------------------------------------------------------
struct ActRows {
  int64_t k64 = 0;
  std::vector<int8_t> a;
  std::vector<float> al, ao16;
};

void quantize_row(const void* x, bool x_f32, int64_t K, int8_t* a, float* al, float* ao16) {
  float v[32];
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t n = std::min<int64_t>(32, K - k);
    float amax = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      v[i] = x_f32 ? static_cast<const float*>(x)[k + i] : bf16_to_f32(static_cast<const uint16_t*>(x)[k + i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sums[2] = {0, 0};
    for (int64_t i = 0; i < 32; ++i) {
      const int qi = i < n ? static_cast<int>(std::nearbyint(v[i] * inv)) : 0;
      a[k + i] = static_cast<int8_t>(qi);
      sums[i / 16] += qi;
    }
    for (int l = 0; l < 8; ++l) al[k / 4 + l] = d;
    ao16[k / 16] = d * sums[0], ao16[k / 16 + 1] = d * sums[1];
  }
}

void quantize_rows(const void* x, bool x_f32, int64_t M, int64_t K, ActRows& acts) {
  acts.k64 = (K + 63) / 64 * 64;
  acts.a.assign(M * acts.k64, 0), acts.al.assign(M * acts.k64 / 4, 0.f), acts.ao16.assign(M * acts.k64 / 16, 0.f);
  const int64_t esize = x_f32 ? 4 : 2;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(static_cast<const char*>(x) + m * K * esize, x_f32, K, acts.a.data() + m * acts.k64,
                   acts.al.data() + m * acts.k64 / 4, acts.ao16.data() + m * acts.k64 / 16);
  });
}

// ---- dot kernels: NR weight rows x MR activation rows, each output on its own accumulators ---------------------
void store_out(void* out, bool out_f32, int64_t idx, float v) {
  if (out_f32)
    static_cast<float*>(out)[idx] = v;
  else
    static_cast<uint16_t*>(out)[idx] = f32_to_bf16(v);
}

// sum_b o16[b] * ao16[b] in 16 lanes (b mod 16), then the lanes in order: the same in both builds
float offset_term(const float* o16, const float* ao16, int64_t nb) {
#if PL_VNNI
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 m = nb - b >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (nb - b)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, o16 + b), _mm512_maskz_loadu_ps(m, ao16 + b), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float lanes[16] = {};
  for (int64_t b = 0; b < nb; ++b) lanes[b % 16] += o16[b] * ao16[b];
  float s = 0.f;
  for (float v : lanes) s += v;
  return s;
#endif
}

// A weight row read 64 elements at a time: codes q and lane scales s per chunk; o16() its per-16 offsets once
// every chunk was read. BufferedRow reads an unpacked row (any type, any batch size).
struct BufferedRow {
  const WeightRow* w;
  const float* o16() const { return w->o16.data(); }
#if PL_VNNI
  void chunk(int64_t k, __m512i& q, __m512& s) const {
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    q = _mm512_loadu_si512(w->q.data() + k);
    s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(w->s16.data() + k / 16)));
  }
#endif
};

#if PL_VNNI
// StoredRow decodes the stored blocks straight into registers (decode batches: no unpacked copy of the row). It
// produces exactly the codes, scales and offsets unpack_block does, so both give the same bits.
template <int64_t t>
struct StoredRow {
  const uint8_t* row;
  float* o;  // per-16 offsets, written chunk by chunk
  float sc[8], mn[8];  // the current K-quant super-block's sub-block scales and mins

  const float* o16() const { return o; }

  void chunk(int64_t k, __m512i& q, __m512& s) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    if constexpr (t == kQ4_K) {
      const uint8_t* b = row + k / 256 * 144;
      const int c = static_cast<int>(k % 256) / 64;
      if (c == 0)
        for (int j = 0; j < 8; ++j) scale_min_k4(b + 4, j, f16_at(b), f16_at(b + 2), &sc[j], &mn[j]);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
      q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low4)),
                             _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), 1);
      s = _mm512_insertf32x8(_mm512_set1_ps(sc[2 * c]), _mm256_set1_ps(sc[2 * c + 1]), 1);
      o[k / 16] = o[k / 16 + 1] = mn[2 * c], o[k / 16 + 2] = o[k / 16 + 3] = mn[2 * c + 1];
    } else {
      constexpr int64_t bytes = type_info(t).bytes;
      const uint8_t* b0 = row + k / 32 * bytes;
      const uint8_t* b1 = b0 + bytes;
      const float d0 = f16_at(b0), d1 = f16_at(b1);
      float o0, o1;
      if constexpr (t == kQ8_0) {
        const __m512i z = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)), 1);
        q = _mm512_xor_si512(z, _mm512_set1_epi8(static_cast<char>(0x80)));
        o0 = -128.f * d0, o1 = -128.f * d1;
      } else {  // Q4_0, Q4_1: [low nibbles 0, high 0, low 1, high 1] in 128-bit lanes
        constexpr int qs = t == kQ4_0 ? 2 : 4;
        const __m256i v = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b1 + qs),
                                              reinterpret_cast<const __m128i*>(b0 + qs));
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low4)),
                                             _mm256_and_si256(_mm256_srli_epi16(v, 4), low4), 1);
        q = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
        o0 = t == kQ4_0 ? -8.f * d0 : f16_at(b0 + 2), o1 = t == kQ4_0 ? -8.f * d1 : f16_at(b1 + 2);
      }
      s = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
      o[k / 16] = o[k / 16 + 1] = o0, o[k / 16 + 2] = o[k / 16 + 3] = o1;
    }
  }
};

template <int NR, int MR, class Src>
void dot_tile(Src* w, const ActRows& acts, int64_t m0, float (*res)[MR]) {
  const int64_t k64 = acts.k64;
  __m512 acc[NR][MR];  // the loops over r and j are unrolled so that acc[][] stays in registers
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k64; k += 64) {
    __m512i q[NR];
    __m512 s[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) w[r].chunk(k, q[r], s[r]);
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      const int64_t row = (m0 + j) * k64;
      const __m512i a = _mm512_loadu_si512(acts.a.data() + row + k);
      const __m512 al = _mm512_loadu_ps(acts.al.data() + (row + k) / 4);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[r], a);
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s[r], al), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < MR; ++j)
      res[r][j] = _mm512_reduce_add_ps(acc[r][j]) +
                  offset_term(w[r].o16(), acts.ao16.data() + (m0 + j) * k64 / 16, k64 / 16);
}
#else
template <int NR, int MR, class Src>
void dot_tile(Src* src, const ActRows& acts, int64_t m0, float (*res)[MR]) {
  const int64_t k64 = acts.k64;
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < MR; ++j) {
      const WeightRow* w = src[r].w;
      const int64_t row = (m0 + j) * k64;
      float acc[16] = {};
      for (int64_t k = 0; k < k64; k += 64)
        for (int l = 0; l < 16; ++l) {
          int32_t dot = 0;
          for (int i = 0; i < 4; ++i) dot += int32_t(w->q[k + 4 * l + i]) * acts.a[row + k + 4 * l + i];
          acc[l] += float(dot) * (w->s16[k / 16 + l / 4] * acts.al[(row + k) / 4 + l]);
        }
      float sum = 0.f;
      for (float v : acc) sum += v;
      res[r][j] = sum + offset_term(w->o16.data(), acts.ao16.data() + row / 16, k64 / 16);
    }
}
#endif

template <int NR, class Src>
void dot_rows(Src* w, const ActRows& acts, int64_t M, int64_t n, void* out, bool out_f32, int64_t ldo) {
  constexpr int MR = 4;
  int64_t m = 0;
  for (; m + MR <= M; m += MR) {
    float res[NR][MR];
    dot_tile<NR, MR>(w, acts, m, res);
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < MR; ++j) store_out(out, out_f32, (m + j) * ldo + n + r, res[r][j]);
  }
  for (; m < M; ++m) {
    float res[NR][1];
    dot_tile<NR, 1>(w, acts, m, res);
    for (int r = 0; r < NR; ++r) store_out(out, out_f32, m * ldo + n + r, res[r][0]);
  }
}

constexpr int kNR = 2;  // weight rows per tile

// Rows n0..n1 through an unpacked copy of each weight row (reused by every activation row).
void rows_buffered(int64_t t, const uint8_t* w, int64_t row_bytes, const ActRows& acts, int64_t M, int64_t K,
                   int64_t n0, int64_t n1, void* out, bool out_f32, int64_t ldo) {
  thread_local WeightRow buf[kNR];
  for (auto& b : buf)
    if (static_cast<int64_t>(b.q.size()) != acts.k64) b.resize(acts.k64);
  BufferedRow rows[kNR] = {{&buf[0]}, {&buf[1]}};
  int64_t n = n0;
  for (; n + kNR <= n1; n += kNR) {
    for (int r = 0; r < kNR; ++r) unpack_row(t, w + (n + r) * row_bytes, K, buf[r]);
    dot_rows<kNR>(rows, acts, M, n, out, out_f32, ldo);
  }
  for (; n < n1; ++n) {
    unpack_row(t, w + n * row_bytes, K, buf[0]);
    dot_rows<1>(rows, acts, M, n, out, out_f32, ldo);
  }
}

#if PL_VNNI
template <int64_t t>
void rows_stored(const uint8_t* w, int64_t row_bytes, const ActRows& acts, int64_t M, int64_t K, int64_t n0,
                 int64_t n1, void* out, bool out_f32, int64_t ldo) {
  thread_local std::vector<float> offsets;
  offsets.resize(kNR * K / 16);
  StoredRow<t> rows[kNR];
  for (int r = 0; r < kNR; ++r) rows[r].o = offsets.data() + r * K / 16;
  int64_t n = n0;
  for (; n + kNR <= n1; n += kNR) {
    for (int r = 0; r < kNR; ++r) rows[r].row = w + (n + r) * row_bytes;
    dot_rows<kNR>(rows, acts, M, n, out, out_f32, ldo);
  }
  for (; n < n1; ++n) {
    rows[0].row = w + n * row_bytes;
    dot_rows<1>(rows, acts, M, n, out, out_f32, ldo);
  }
}
#endif

// Up to this many activation rows, types with a StoredRow read their blocks directly.
constexpr int64_t kStoredRowsMaxM = 4;

bool reads_stored(int64_t t, int64_t M, int64_t K) {
  return PL_VNNI && M <= kStoredRowsMaxM && K % 64 == 0 &&
         (t == kQ4_0 || t == kQ4_1 || t == kQ8_0 || t == kQ4_K);
}

}  // namespace

bool quant_type_supported(int64_t qtype) { return type_info(qtype).block != 0; }

int64_t quant_row_bytes(int64_t qtype, int64_t K) {
  if (qtype >= kPackedBase) return packed_row_bytes(qtype - kPackedBase, K);
  const TypeInfo ti = type_info(qtype);
  return ti.block && K % ti.block == 0 ? K / ti.block * ti.bytes : 0;
}

void quant_gemm_raw(const void* x, bool x_f32, const uint8_t* w, int64_t qtype, void* out, bool out_f32,
                    int64_t M, int64_t N, int64_t K, int64_t ldo) {
  if (qtype >= kPackedBase) return quant_gemm_packed(x, x_f32, w, qtype - kPackedBase, out, out_f32, M, N, K, ldo);
  const int64_t row_bytes = quant_row_bytes(qtype, K);
  TORCH_CHECK(row_bytes > 0, "quant_gemm: unsupported type ", qtype, " or K ", K, " not a multiple of its block");
  if (M == 0 || N == 0) return;
  ActRows acts;
  quantize_rows(x, x_f32, M, K, acts);
  // Grain: ~32 KiB of stored weights per task (decode); at least a tile of rows.
  const int64_t grain = std::max<int64_t>(kNR, (32768 / std::max<int64_t>(row_bytes, 1)) / kNR * kNR);
  const bool stored = reads_stored(qtype, M, K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
#if PL_VNNI
    if (stored) {
      switch (qtype) {
        case kQ4_0: return rows_stored<kQ4_0>(w, row_bytes, acts, M, K, n0, n1, out, out_f32, ldo);
        case kQ4_1: return rows_stored<kQ4_1>(w, row_bytes, acts, M, K, n0, n1, out, out_f32, ldo);
        case kQ8_0: return rows_stored<kQ8_0>(w, row_bytes, acts, M, K, n0, n1, out, out_f32, ldo);
        case kQ4_K: return rows_stored<kQ4_K>(w, row_bytes, acts, M, K, n0, n1, out, out_f32, ldo);
      }
    }
#endif
    rows_buffered(qtype, w, row_bytes, acts, M, K, n0, n1, out, out_f32, ldo);
  });
}

}  // namespace pagedllm

namespace {

// out [M, N] (bf16 or fp32) = x [M, K] (bf16 or fp32) @ w^T, w: uint8 [N, row_bytes] in ggml type `qtype`.
void quant_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "quant_gemm: x must be contiguous bf16/fp32 [M, K]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == w.size(0) &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "quant_gemm: out must be bf16/fp32 [M, N] with unit column stride");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
                  w.size(1) == pagedllm::quant_row_bytes(qtype, x.size(1)),
              "quant_gemm: w must be contiguous uint8 [N, row bytes of type ", qtype, " for K = ", x.size(1), "]");
  pagedllm::quant_gemm_raw(x.data_ptr(), x.scalar_type() == at::kFloat, w.data_ptr<uint8_t>(), qtype,
                           out.data_ptr(), out.scalar_type() == at::kFloat, x.size(0), w.size(0), x.size(1),
                           out.stride(0));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("quant_gemm", &quant_gemm);
}
