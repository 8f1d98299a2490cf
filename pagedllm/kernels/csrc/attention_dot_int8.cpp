// "int8 dot" path: every tile over an int8 KV cache, on a CPU with AVX512-VNNI. q . k runs on integers: each
// query row is rounded once per tile to int8 in blocks of 32 values with one fp32 scale per block (llama.cpp's
// q8_0), and vpdpbusd multiplies it with the K rows as stored, 64 products per instruction, with no widening.
// V rows are widened in registers as they are accumulated (attend_dot_chunks). Against the dequantize-then-attend
// reference this differs by the rounding of q (tests: the reference on the same rounded q, kv_quant.round_queries,
// is equal to rounding). Each row is computed on its own, so the path is batch-invariant like the fp32 dot path.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention.h"

#if PA_INT8_DOT
#include "attention_avx512.h"

namespace pagedllm::attn {

// reduce16 (common.h) for the integer lane sums of one 64-byte K vector per key, whose lanes 0-7 and 8-15 belong
// to q blocks of different scales: the tree's first three levels add lanes of one block only (exact in int32),
// then each block's sums are converted and scaled (the 128-bit lanes of w alternate block 0, block 1), and the
// last level adds the blocks. Two conversions and two multiplies per row and chunk instead of sixteen.
inline __m512 reduce16_scaled(const __m512i* v, __m512 block_scales) {
  __m512i t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)
    t[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]),
                            _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)
    u[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * k], t[2 * k + 1]),
                            _mm512_unpackhi_epi64(t[2 * k], t[2 * k + 1]));
  __m512 f[2];
  for (int k = 0; k < 2; ++k) {
    w[k] = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2 * k], u[2 * k + 1], 0x88),
                            _mm512_shuffle_i32x4(u[2 * k], u[2 * k + 1], 0xDD));
    f[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(w[k]), block_scales);
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], 0x88), _mm512_shuffle_f32x4(f[0], f[1], 0xDD));
}

// vpdpbusd multiplies unsigned by signed bytes: K rows go in as k + 128 (k xor 0x80), and each 4-byte lane's
// accumulator starts at -128 x (the lane's q codes summed), so that the integer sums are exactly k . q_int8.
// An item may take several KV heads (kDotInt8MaxHeads; the planner's choice): a token's rows of all heads sit
// side by side, and 66-byte int8 rows read one head at a time would pull most cache lines twice.
template <int ND>
struct Int8Chunk {
  static constexpr int D = ND * 16;
  static constexpr int NZ = (D + 63) / 64;  // 64-byte vectors per K row (a 32-wide row fills half of one)
  static constexpr __mmask64 kRowMask = D >= 64 ? ~__mmask64{0} : (__mmask64{1} << D) - 1;
  const Problem& p;
  const int64_t h, nh;  // the item's KV heads h .. h + nh - 1
  const int8_t* vr[kDotInt8MaxHeads][kChunk];
  alignas(64) uint8_t kx[kDotInt8MaxHeads][kChunk][NZ * 64];  // the chunk's K rows + 128, per head
  alignas(64) int8_t qc[kMaxRows][NZ * 64];        // the tile's rounded query rows (zero past D)
  alignas(64) float lane_scale[kMaxRows][NZ * 16];  // per dpbusd lane: the scale of the q block it covers
  alignas(64) int32_t lane_bias[kMaxRows][NZ * 16];  // per lane: -128 x its 4 q codes summed
  __m512 block_scales[NZ == 1 ? kMaxRows : 1];  // head dims 32, 64: per 128-bit lane, q block 0, 1, 0, 1's scale
  __m512 ksv[kDotInt8MaxHeads], vsv[kDotInt8MaxHeads];  // the keys' scales per head

  Int8Chunk(const Problem& prob, const Item& it, Scratch& s, int64_t rows) : p(prob), h(it.h), nh(it.nh) {
    std::memset(qc, 0, sizeof(qc[0]) * rows);
    std::memset(lane_scale, 0, sizeof(lane_scale[0]) * rows);
    std::memset(lane_bias, 0, sizeof(lane_bias[0]) * rows);
    for (int64_t i = 0; i < rows; ++i) {
      round_row(s.qbuf.get() + i * D, i);
      if constexpr (NZ == 1) {  // lane_scale's lanes 0 and 8 hold the two blocks' scales (0 past D)
        const __m128 b0 = _mm_set1_ps(lane_scale[i][0]), b1 = _mm_set1_ps(lane_scale[i][8]);
        const __m256 pair = _mm256_insertf128_ps(_mm256_castps128_ps256(b0), b1, 1);
        block_scales[i] = _mm512_insertf32x8(_mm512_castps256_ps512(pair), pair, 1);
      }
    }
  }

  // One query row (fp32, already times scale * log2 e) to int8 codes, per block of 32: scale = amax / 127.
  void round_row(const float* q, int64_t i) {
    for (int b = 0; b < D / 32; ++b) {
      const __m512 x0 = _mm512_loadu_ps(q + b * 32), x1 = _mm512_loadu_ps(q + b * 32 + 16);
      const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(x0)), _mm512_reduce_max_ps(_mm512_abs_ps(x1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv));  // round to nearest even, |c| <= 127
      const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(&qc[i][b * 32]), _mm512_cvtsepi32_epi8(c0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(&qc[i][b * 32 + 16]), _mm512_cvtsepi32_epi8(c1));
      for (int l = 0; l < 8; ++l) {  // the 8 lanes of this block
        const int8_t* c = &qc[i][b * 32 + l * 4];
        lane_scale[i][b * 8 + l] = amax / 127.f;
        lane_bias[i][b * 8 + l] = -128 * (c[0] + c[1] + c[2] + c[3]);
      }
    }
  }

  void load(KeyCursor& cur, int64_t nk) {
    alignas(32) uint16_t ksh[kDotInt8MaxHeads][kChunk] = {}, vsh[kDotInt8MaxHeads][kChunk] = {};  // f16, 0 past nk
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t j = 0; j < nk; ++j, cur.next()) {
      const int64_t row = cur.slot() * p.kv_tok_stride + h * p.kv_head_stride;
      for (int64_t hh = 0; hh < nh; ++hh) {
        const int64_t off = row + hh * p.kv_head_stride;
        const int8_t* ks = static_cast<const int8_t*>(p.kc) + off;
        vr[hh][j] = static_cast<const int8_t*>(p.vc) + off;
        std::memcpy(&ksh[hh][j], ks + D, sizeof(uint16_t));
        std::memcpy(&vsh[hh][j], vr[hh][j] + D, sizeof(uint16_t));
        for (int z = 0; z < NZ; ++z)
          _mm512_store_si512(kx[hh][j] + z * 64,
                             _mm512_xor_si512(_mm512_maskz_loadu_epi8(kRowMask, ks + z * 64), bias));
      }
    }
    for (int64_t hh = 0; hh < nh; ++hh) {
      for (int64_t j = nk; j < kChunk; ++j) {  // missing keys: any finite row (their scores are masked)
        std::memcpy(kx[hh][j], kx[hh][0], sizeof(kx[hh][0]));
        vr[hh][j] = vr[hh][0];
      }
      ksv[hh] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ksh[hh])));
      vsv[hh] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(vsh[hh])));
    }
  }

  // Row i's 16 scores: per key, exact integer lane sums, each lane times its q block's scale, reduced; times the
  // key's scale.
  __m512 scores(int64_t i, int64_t hh) const {
    __m512i qv[NZ], bias[NZ];
    __m512 ls[NZ];
    for (int z = 0; z < NZ; ++z) {
      qv[z] = _mm512_load_si512(qc[i] + z * 64);
      bias[z] = _mm512_load_si512(lane_bias[i] + z * 16);
      ls[z] = _mm512_load_ps(lane_scale[i] + z * 16);
    }
    if constexpr (NZ == 1) {  // head dims 32, 64: integer sums up to the blocks
      __m512i isum[kChunk];
      for (int j = 0; j < kChunk; ++j) isum[j] = _mm512_dpbusd_epi32(bias[0], _mm512_load_si512(kx[hh][j]), qv[0]);
      return _mm512_mul_ps(reduce16_scaled(isum, block_scales[i]), ksv[hh]);
    }
    __m512 sacc[kChunk];
    for (int j = 0; j < kChunk; ++j) {
      const uint8_t* k = kx[hh][j];
      __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(bias[0], _mm512_load_si512(k), qv[0])), ls[0]);
      for (int z = 1; z < NZ; ++z)
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(bias[z], _mm512_load_si512(k + z * 64), qv[z])),
                            ls[z], a);
      sacc[j] = a;
    }
    return _mm512_mul_ps(reduce16(sacc), ksv[hh]);
  }
  __m512 prob_scale(int64_t hh) const { return vsv[hh]; }
  const int8_t* const* values(int64_t hh) const { return vr[hh]; }
};

PA_DOT_PATH(attend_dot_int8, Int8Chunk)

}  // namespace pagedllm::attn
#endif
