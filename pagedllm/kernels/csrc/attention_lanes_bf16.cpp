// "lanes" path for bf16 queries over a bf16 cache on an AVX512-BF16 CPU.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention.h"

#if PL_AVX512_BF16
#include "attention_avx512.h"

namespace pagedllm::attn {

using pagedllm::bf16_to_f32;
using pagedllm::f32_to_bf16;

// One chunk of attend_lanes_bf16 for the VN row vectors v .. v + VN - 1: scores, online softmax, values. With
// VN = 2 every broadcast key pair and value pair feeds two vectors (a load per two vdpbf16ps instead of one).
template <int ND, int VN>
inline void lanes_chunk_bf16(const uint32_t* qt, int64_t mp, int v, const uint32_t* kw, const uint32_t* vp,
                             const int32_t* pos, int64_t c, int64_t nk, __m512* mv, __m512* lv, float* accT,
                             __m512 qscale, __m512i interleave) {
  constexpr int D = ND * 16;
  constexpr int NP = D / 2;
  constexpr int J = kChunk / VN;  // keys per pass, so that VN x J accumulators fit in registers
  __m512 sc[VN][kChunk];
  for (int h = 0; h < kChunk; h += J) {
    __m512 a[VN][J];
    for (int x = 0; x < VN; ++x)
      for (int j = 0; j < J; ++j) a[x][j] = _mm512_setzero_ps();
    for (int e = 0; e < NP; ++e) {
      __m512bh qd[VN];
      for (int x = 0; x < VN; ++x) qd[x] = (__m512bh)_mm512_loadu_si512(qt + e * mp + (v + x) * 16);
      for (int j = 0; j < J; ++j) {
        const __m512bh kp = (__m512bh)_mm512_set1_epi32(static_cast<int>(kw[(h + j) * NP + e]));
        for (int x = 0; x < VN; ++x) a[x][j] = _mm512_dpbf16_ps(a[x][j], qd[x], kp);
      }
    }
    for (int x = 0; x < VN; ++x)
      for (int j = 0; j < J; ++j) sc[x][h + j] = _mm512_mul_ps(a[x][j], qscale);
  }
  __m512 alpha[VN];
  __m512i pw[VN][kChunk / 2], pl[VN][kChunk / 2];  // per row: bf16 pair (p[j], p[j + 1]) of key pair j / 2, hi/lo
  for (int x = 0; x < VN; ++x) {
    alpha[x] = lanes_softmax(sc[x], pos + (v + x) * 16, c, nk, mv[v + x], lv[v + x]);
    for (int m = 0; m < kChunk / 2; ++m) {
      __m512i hi, lo;
      split_bf16_pairs(sc[x][2 * m], sc[x][2 * m + 1], hi, lo);
      pw[x][m] = _mm512_permutexvar_epi16(interleave, hi);
      pl[x][m] = _mm512_permutexvar_epi16(interleave, lo);
    }
  }
  for (int q0 = 0; q0 < D; q0 += 8) {
    __m512 a[VN][8];
    for (int x = 0; x < VN; ++x)
      for (int e = 0; e < 8; ++e)
        a[x][e] = _mm512_mul_ps(_mm512_loadu_ps(accT + (q0 + e) * mp + (v + x) * 16), alpha[x]);
    for (int m = 0; m < kChunk / 2; ++m)
      for (int e = 0; e < 8; ++e) {
        const __m512bh vv = (__m512bh)_mm512_set1_epi32(static_cast<int>(vp[m * D + q0 + e]));
        for (int x = 0; x < VN; ++x)
          a[x][e] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[x][e], (__m512bh)pw[x][m], vv), (__m512bh)pl[x][m], vv);
      }
    for (int x = 0; x < VN; ++x)
      for (int e = 0; e < 8; ++e) _mm512_storeu_ps(accT + (q0 + e) * mp + (v + x) * 16, a[x][e]);
  }
}

// "lanes" path for bf16 queries over a bf16 cache (prefill of bf16 models): as attend_lanes, with vdpbf16ps.
// Scores: the query pairs (q[e], q[e+1]) of 16 rows against a broadcast key pair, straight from the bf16 rows.
// Values: the probabilities of keys j, j+1 as bf16 pairs (high and low parts) interleaved per row, the V rows of
// the chunk packed as pairs (v[j][e], v[j+1][e]), so one instruction per part adds two keys for 16 rows.
template <int ND>
void attend_lanes_bf16(const Problem& p, const Item& it, Scratch& s, float* partials) {
  constexpr int D = ND * 16;
  constexpr int NB = ND / 2;  // 32-element bf16 vectors per row
  constexpr int NP = D / 2;   // bf16 pairs per row
  const int64_t rows = item_rows(p, it);
  const int64_t nvec = (rows + 15) / 16;
  const int64_t mp = nvec * 16;
  uint32_t* qt = reinterpret_cast<uint32_t*>(s.qbuf.get());  // query pairs, transposed [NP][mp] (raw, unscaled)
  float* accT = s.accT.get();                                  // [D][mp], dims in pair_dim order
  uint16_t* kb = reinterpret_cast<uint16_t*>(s.kbuf.get());    // the chunk's K rows, packed [kChunk][D]
  uint32_t* vp = reinterpret_cast<uint32_t*>(s.vbuf.get());    // the chunk's V pairs [kChunk / 2][D]
  int32_t* pos = s.pos.data();
  const int64_t n_new = p.qsl[it.r + 1] - p.qsl[it.r];
  for (int64_t i = 0; i < mp; ++i) {
    const auto [t, head] = row_of(p, it, std::min(i, rows - 1));  // padding rows repeat the last one
    const uint32_t* src = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.q) +
                                                            (p.qsl[it.r] + t) * p.q_tok_stride +
                                                            head * p.q_head_stride);
    for (int64_t e = 0; e < NP; ++e) qt[e * mp + i] = src[e];
    pos[i] = static_cast<int32_t>(p.seq_lens[it.r] - n_new + t);
  }
  std::fill(accT, accT + D * mp, 0.f);
  __m512 mv[kMaxRows / 16], lv[kMaxRows / 16];
  for (int v = 0; v < nvec; ++v) {
    mv[v] = _mm512_set1_ps(kNegInf);
    lv[v] = _mm512_setzero_ps();
  }
  // interleaves two vectors of 16 bf16 probabilities (keys j, j + 1) into 16 pairs, one per row
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const __m512 qscale = _mm512_set1_ps(p.qscale);
  const int32_t* table = p.bt + static_cast<int64_t>(it.r) * p.maxb;
  KeyCursor cur(table, p.bs, it.k0);
  const uint16_t* kr[kPairChunk];
  const uint16_t* vr[kPairChunk];
  for (int64_t c = it.k0; c < it.k1; c += kChunk) {
    const int64_t nk = std::min<int64_t>(kChunk, it.k1 - c);
    chunk_ptrs(p, it.h, cur, nk, kr, vr);
    for (int j = 0; j < kChunk; ++j)
      for (int b = 0; b < NB; ++b) _mm512_store_si512(kb + j * D + 32 * b, _mm512_loadu_si512(kr[j] + 32 * b));
    for (int m = 0; m < kChunk / 2; ++m)
      for (int b = 0; b < NB; ++b) {
        const __m512i x = _mm512_loadu_si512(vr[2 * m] + 32 * b), y = _mm512_loadu_si512(vr[2 * m + 1] + 32 * b);
        _mm512_store_si512(vp + m * D + 32 * b, _mm512_unpacklo_epi16(x, y));
        _mm512_store_si512(vp + m * D + 32 * b + 16, _mm512_unpackhi_epi16(x, y));
      }
    const uint32_t* kw = reinterpret_cast<const uint32_t*>(kb);
    for (int v = 0; v < nvec;) {
      if (pos[v * 16 + 15] < c) {  // positions grow with the row: every row of v is before this chunk
        ++v;
      } else if (v + 1 < nvec) {
        lanes_chunk_bf16<ND, 2>(qt, mp, v, kw, vp, pos, c, nk, mv, lv, accT, qscale, interleave);
        v += 2;
      } else {
        lanes_chunk_bf16<ND, 1>(qt, mp, v, kw, vp, pos, c, nk, mv, lv, accT, qscale, interleave);
        ++v;
      }
    }
  }
  finish_lanes<D>(p, it, s, mv, lv, accT, partials, pair_dim);
}

PA_INSTANTIATE(attend_lanes_bf16)

}  // namespace pagedllm::attn
#endif
