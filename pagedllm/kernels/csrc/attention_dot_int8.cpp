// "int8 dot" path: every tile over an int8 KV cache, on a CPU with AVX512-VNNI. Both products run on integers:
// each query row is rounded once per tile to int8 in blocks of 32 values with one fp32 scale per block (llama.cpp's
// q8_0) for q . k on vpdpbusd against the K rows as stored; each chunk's probabilities are rounded to 15 bits for
// p . V on vpdpwssd against the V rows widened to int16. Against the dequantize-then-attend reference this differs
// by the rounding of q (tests: the reference on the same rounded q, kv_quant.round_queries) and of the
// probabilities (up to 2^-15 of a chunk's largest). Each row is computed on its own, so the path is batch-invariant
// like the fp32 dot path.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "attention.h"

#if PL_VNNI
#include "attention_avx512.h"

namespace pagedllm::attn {

// In place: r[t] lane j <- r[j] lane t, for 16 x 16 dwords (four rounds of 16 shuffles).
inline void transpose16(__m512i* r) {
  __m512i s[16];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane: rows 2k, 2k + 1 interleaved by dword
    s[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    s[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  __m512i v[4][4];  // v[k][x], 128-bit lane L: dword 4L + x of rows 4k .. 4k + 3
  for (int k = 0; k < 4; ++k) {
    v[k][0] = _mm512_unpacklo_epi64(s[4 * k], s[4 * k + 2]);
    v[k][1] = _mm512_unpackhi_epi64(s[4 * k], s[4 * k + 2]);
    v[k][2] = _mm512_unpacklo_epi64(s[4 * k + 1], s[4 * k + 3]);
    v[k][3] = _mm512_unpackhi_epi64(s[4 * k + 1], s[4 * k + 3]);
  }
  for (int x = 0; x < 4; ++x) {  // a 4 x 4 transpose of 128-bit lanes: r[4L + x] lane k = v[k][x] lane L
    const __m512i e0 = _mm512_shuffle_i32x4(v[0][x], v[1][x], 0x44), e1 = _mm512_shuffle_i32x4(v[0][x], v[1][x], 0xEE);
    const __m512i e2 = _mm512_shuffle_i32x4(v[2][x], v[3][x], 0x44), e3 = _mm512_shuffle_i32x4(v[2][x], v[3][x], 0xEE);
    r[x] = _mm512_shuffle_i32x4(e0, e2, 0x88);
    r[4 + x] = _mm512_shuffle_i32x4(e0, e2, 0xDD);
    r[8 + x] = _mm512_shuffle_i32x4(e1, e3, 0x88);
    r[12 + x] = _mm512_shuffle_i32x4(e1, e3, 0xDD);
  }
}

// The two products of a chunk of 16 keys:
//   * q . k on vpdpbusd (4 unsigned x 4 signed bytes per 32-bit lane): the chunk's K rows are transposed once
//     (kt[t] lane j = dims 4t .. 4t + 3 of key j, as k + 128, i.e. k xor 0x80), so a row's 16 scores are 16-lane
//     integer sums with nothing to reduce: kt[t] against q's 4 codes t broadcast. Each q block's sum starts at
//     -128 x (its codes summed), so it is exactly k . q_int8; then each block is scaled and the blocks added in a
//     fixed order.
//   * p . V on vpdpwssd (2 x 2 int16 per lane): a row's 16 probabilities times the keys' V scales are rounded to
//     15 bits (scale: their max / 32767) and multiply the chunk's V rows widened to int16, 2 keys to a lane (vw).
//     (8 bits on vpdpbusd are faster but too coarse: the keys of a chunk beside its largest one keep a bit or
//     two.) Each chunk's sums are scaled and added into a float accumulator whose dims sit in the interleave's
//     order (unpermute).
// Every row is computed on its own over chunks at fixed key positions, so the path is batch-invariant.
// An item may take several KV heads (kDotInt8MaxHeads; the planner's choice): a token's rows of all heads sit
// side by side, and 66-byte int8 rows read one head at a time would pull most cache lines twice.
template <int ND>
struct Int8Chunk {
  static constexpr int D = ND * 16;
  static constexpr float kProbMax = 32767.f;  // probabilities are rounded to 15 bits per chunk
  static constexpr float kMinProb = 1e-30f;   // a chunk's largest probability x V scale below this adds nothing
  static constexpr int NZ = (D + 63) / 64;  // 64-byte vectors per row (a 32-wide row fills half of one)
  static constexpr int NT = D / 4;          // transposed K vectors: 4 dims of 16 keys each
  static constexpr int NB = D / 32;         // q blocks
  static constexpr int NW = D / 16;         // vectors of 16 dims x 2 keys in int16 per pair of V rows
  static constexpr __mmask64 kRowMask = D >= 64 ? ~__mmask64{0} : (__mmask64{1} << D) - 1;
  const Problem& p;
  const int64_t h, nh;  // the item's KV heads h .. h + nh - 1
  alignas(64) uint8_t kt[kDotInt8MaxHeads][NT][64];       // per head: the chunk's K rows + 128, transposed
  alignas(64) int16_t vw[kDotInt8MaxHeads][kChunk / 2][NW][32];  // per head, per 2 keys: V widened, interleaved
  alignas(64) float accp[kMaxRows][D];  // per row: sum p V, dims in the interleave's order (see load)
  alignas(64) int8_t qc[kMaxRows][D];                      // the tile's rounded query rows
  float block_scale[kMaxRows][NB];                         // per q block: its scale
  int32_t block_bias[kMaxRows][NB];                        // per q block: -128 x its codes summed
  __m512 ksv[kDotInt8MaxHeads], vsv[kDotInt8MaxHeads];     // the keys' scales per head

  Int8Chunk(const Problem& prob, const Item& it, Scratch& s, int64_t rows) : p(prob), h(it.h), nh(it.nh) {
    std::memset(accp, 0, sizeof(accp[0]) * rows);
    for (int64_t i = 0; i < rows; ++i) round_row(s.qbuf.get() + i * D, i);
  }

  // One query row (fp32, already times scale * log2 e) to int8 codes, per block of 32: scale = amax / 127.
  void round_row(const float* q, int64_t i) {
    for (int b = 0; b < NB; ++b) {
      const __m512 x0 = _mm512_loadu_ps(q + b * 32), x1 = _mm512_loadu_ps(q + b * 32 + 16);
      const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(x0)), _mm512_reduce_max_ps(_mm512_abs_ps(x1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv));  // round to nearest even, |c| <= 127
      const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(&qc[i][b * 32]), _mm512_cvtsepi32_epi8(c0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(&qc[i][b * 32 + 16]), _mm512_cvtsepi32_epi8(c1));
      block_scale[i][b] = amax / 127.f;
      block_bias[i][b] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
    }
  }

  // The next nk keys (missing ones: copies of the first, their scores are masked and their codes 0).
  void load(KeyCursor& cur, int64_t nk) {
    alignas(32) uint16_t ksh[kDotInt8MaxHeads][kChunk] = {}, vsh[kDotInt8MaxHeads][kChunk] = {};  // f16, 0 past nk
    int64_t row[kChunk];
    for (int64_t j = 0; j < nk; ++j, cur.next()) row[j] = cur.slot() * p.kv_tok_stride + h * p.kv_head_stride;
    for (int64_t j = nk; j < kChunk; ++j) row[j] = row[0];
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int8_t* kc = static_cast<const int8_t*>(p.kc) + hh * p.kv_head_stride;
      const int8_t* vc = static_cast<const int8_t*>(p.vc) + hh * p.kv_head_stride;
      for (int64_t j = 0; j < nk; ++j) {
        std::memcpy(&ksh[hh][j], kc + row[j] + D, sizeof(uint16_t));
        std::memcpy(&vsh[hh][j], vc + row[j] + D, sizeof(uint16_t));
      }
      for (int z = 0; z < NZ; ++z) {
        __m512i r[kChunk];
        for (int j = 0; j < kChunk; ++j)
          r[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(kRowMask, kc + row[j] + z * 64), bias);
        transpose16(r);
        for (int t = 0; t < 16 && z * 16 + t < NT; ++t) _mm512_store_si512(kt[hh][z * 16 + t], r[t]);
      }
      // V, 2 keys at a time, widened to int16: vw[q][2y + u], 128-bit lane L, dword c = dim 32y + 8L + 4u + c of
      // keys 2q and 2q + 1
      for (int q = 0; q < kChunk / 2; ++q)
        for (int y = 0; y < D / 32; ++y) {
          const auto* r0 = reinterpret_cast<const __m256i*>(vc + row[2 * q] + 32 * y);
          const auto* r1 = reinterpret_cast<const __m256i*>(vc + row[2 * q + 1] + 32 * y);
          const __m512i v0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(r0));
          const __m512i v1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(r1));
          _mm512_store_si512(vw[hh][q][2 * y], _mm512_unpacklo_epi16(v0, v1));
          _mm512_store_si512(vw[hh][q][2 * y + 1], _mm512_unpackhi_epi16(v0, v1));
        }
      ksv[hh] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ksh[hh])));
      vsv[hh] = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(vsh[hh])));
    }
  }

  // G rows i0 .. i0 + G - 1 of KV head hh over the chunk of keys c .. c + nk - 1: scores, online softmax,
  // p . V. The rows' instruction chains are independent and interleaved, which keeps the core busy (one row's
  // chain is mostly latency); each row's arithmetic is its own, whatever rows share the group.
  template <int G>
  void rows(int64_t i0, int64_t hh, int64_t c, int64_t nk, const int32_t* pos, float* m, float* l) {
    // q . k: per row and q block, NC integer chains (added exactly), scaled, the blocks added in a fixed order
    constexpr int NC = NB >= 4 ? 1 : 4 / NB;  // chains per block: 4 chains per row in all (NB beyond 4)
    __m512i acc[G][NB * NC];
    for (int g = 0; g < G; ++g)
      for (int b = 0; b < NB; ++b)
        for (int k = 0; k < NC; ++k)
          acc[g][b * NC + k] = k == 0 ? _mm512_set1_epi32(block_bias[i0 + g][b]) : _mm512_setzero_si512();
#pragma GCC unroll 32
    for (int t = 0; t < NT; ++t) {
      const __m512i kv = _mm512_load_si512(kt[hh][t]);
      for (int g = 0; g < G; ++g) {
        int32_t qd;
        std::memcpy(&qd, &qc[i0 + g][4 * t], sizeof qd);
        __m512i& a = acc[g][t / 8 * NC + t % NC];
        a = _mm512_dpbusd_epi32(a, kv, _mm512_set1_epi32(qd));
      }
    }
    __m512 pr[G];
    float alpha[G];
    for (int g = 0; g < G; ++g) {
      const int64_t i = i0 + g;
      __m512 f[NB];
      for (int b = 0; b < NB; ++b) {
        __m512i sum = acc[g][b * NC];
        for (int k = 1; k < NC; ++k) sum = _mm512_add_epi32(sum, acc[g][b * NC + k]);
        f[b] = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(block_scale[i][b]));
      }
      for (int w = 1; w < NB; w *= 2)  // the blocks added pairwise, in a fixed tree: ((f0 + f1) + (f2 + f3)) + ...
        for (int b = 0; b + w < NB; b += 2 * w) f[b] = _mm512_add_ps(f[b], f[b + w]);
      const __m512 sv = f[0];
      const int64_t nv = std::clamp<int64_t>(pos[i] - c + 1, 0, nk);  // causal: keys up to the row's position
      if (nv == 0) {  // nothing visible in this chunk: the row's state stays as it is (x 1 + 0 below)
        pr[g] = _mm512_setzero_ps();
        alpha[g] = 1.f;
        continue;
      }
      pr[g] = _mm512_mul_ps(softmax_step(_mm512_mul_ps(sv, ksv[hh]), nv, m[i], l[i], alpha[g]), vsv[hh]);
    }
    // p . V: each row's probabilities x V scales rounded to 0 .. 32767 (scale: their max / 32767)
    alignas(32) uint32_t cw[G][kChunk / 2];
    float ps[G];
    for (int g = 0; g < G; ++g) {
      // A chunk far below the row's running max (exp2_ps gives ~2^-126 there) adds nothing: skipped, for
      // kProbMax / amax would overflow to inf and turn the codes into garbage.
      const float amax = _mm512_reduce_max_ps(pr[g]);
      const __m512 inv = _mm512_set1_ps(amax > kMinProb ? kProbMax / amax : 0.f);
      _mm256_store_si256(reinterpret_cast<__m256i*>(cw[g]),
                         _mm512_cvtusepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(pr[g], inv))));
      ps[g] = amax / kProbMax;
    }
    __m512i ia[G][NW];
    for (int g = 0; g < G; ++g)
      for (int x = 0; x < NW; ++x) ia[g][x] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int q = 0; q < kChunk / 2; ++q) {  // keys 2q, 2q + 1
      __m512i bc[G];
      for (int g = 0; g < G; ++g) bc[g] = _mm512_set1_epi32(static_cast<int32_t>(cw[g][q]));
#pragma GCC unroll 8
      for (int x = 0; x < NW; ++x) {
        const __m512i v = _mm512_load_si512(vw[hh][q][x]);
        for (int g = 0; g < G; ++g) ia[g][x] = _mm512_dpwssd_epi32(ia[g][x], bc[g], v);
      }
    }
    for (int g = 0; g < G; ++g) {
      float* a = accp[i0 + g];
      const __m512 al = _mm512_set1_ps(alpha[g]), pg = _mm512_set1_ps(ps[g]);
      for (int x = 0; x < NW; ++x)
        _mm512_store_ps(a + 16 * x, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[g][x]), pg,
                                                    _mm512_mul_ps(_mm512_load_ps(a + 16 * x), al)));
    }
  }

  // rows<G> for n <= G rows (G fixed at compile time so that the chains stay in registers).
  template <int G>
  void some_rows(int64_t n, int64_t i0, int64_t hh, int64_t c, int64_t nk, const int32_t* pos, float* m, float* l) {
    if constexpr (G > 1) {
      if (n < G) return some_rows<G - 1>(n, i0, hh, c, nk, pos, m, l);
    }
    rows<G>(i0, hh, c, nk, pos, m, l);
  }

  // The rows' accumulators back in dim order, into acc [rows][D].
  void unpermute(float* acc, int64_t nrows) const {
    for (int64_t i = 0; i < nrows; ++i)
      for (int x = 0; x < NW; ++x)              // x = 2y + u
        for (int lane = 0; lane < 4; ++lane) {  // 128-bit lane L
          const int dim = 32 * (x / 2) + 8 * lane + 4 * (x % 2);
          std::memcpy(acc + i * D + dim, accp[i] + 16 * x + 4 * lane, 4 * sizeof(float));
        }
  }
};

template <int ND>
void attend_dot_int8(const Problem& p, const Item& it, Scratch& s, float* partials) {
  // rows computed together: their p . V accumulators fill the registers
  constexpr int kGroup = ND >= 16 ? 1 : ND >= 8 ? 2 : 4;
  const int64_t rows = item_rows(p, it);
  start_tile(p, it, s, rows);
  const int32_t* table = p.bt + static_cast<int64_t>(it.r) * p.maxb;
  KeyCursor cur(table, p.bs, it.k0);
  Prefetcher pf(table, p.bs, it.k0);
  FarPrefetcher far(table, p.bs, it, Prefetcher::kLeadKeys);
  const int64_t per_head = rows / it.nh;
  auto chunk = std::make_unique<Int8Chunk<ND>>(p, it, s, rows);
  for (int64_t c = it.k0; c < it.k1; c += kChunk) {
    const int64_t nk = std::min<int64_t>(kChunk, it.k1 - c);
    far.run(p, it, c);
    pf.run(p, it, c, 2);
    chunk->load(cur, nk);
    for (int64_t hh = 0; hh < it.nh; ++hh)
      for (int64_t i = hh * per_head; i < (hh + 1) * per_head; i += kGroup) {
        pf.run(p, it, c, 2 * kGroup);  // the next chunk's keys a few at a time, spread over the rows
        chunk->template some_rows<kGroup>(std::min<int64_t>(kGroup, (hh + 1) * per_head - i), i, hh, c, nk,
                                          s.pos.data(), s.m.get(), s.l.get());
      }
    pf.run(p, it, c);
  }
  chunk->unpermute(s.acc.get(), rows);
  finish(p, it, s.acc.get(), s.m.get(), s.l.get(), partials);
}
PA_INSTANTIATE(attend_dot_int8)

}  // namespace pagedllm::attn
#endif
