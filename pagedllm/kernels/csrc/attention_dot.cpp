// "dot" path (fp32 arithmetic): few query rows (decode, short prompt tails).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention.h"

#if PA_AVX512
#include "attention_avx512.h"

namespace pagedllm::attn {

using pagedllm::bf16_to_f32;
using pagedllm::f32_to_bf16;

template <int ND, int G>
inline void accumulate_values(float* acc, const float* alpha, const float* probs, const float* const* vr,
                              int64_t nv) {
  constexpr int D = ND * 16;
  __m512 a[G][ND];
  for (int g = 0; g < G; ++g) {
    const __m512 al = _mm512_set1_ps(alpha[g]);
    for (int e = 0; e < ND; ++e) a[g][e] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + e * 16), al);
  }
  for (int64_t j = 0; j < nv; ++j) {
    __m512 v[ND];
    for (int e = 0; e < ND; ++e) v[e] = _mm512_loadu_ps(vr[j] + e * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 pj = _mm512_set1_ps(probs[g * kChunk + j]);
      for (int e = 0; e < ND; ++e) a[g][e] = _mm512_fmadd_ps(pj, v[e], a[g][e]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int e = 0; e < ND; ++e) _mm512_storeu_ps(acc + g * D + e * 16, a[g][e]);
}

// accumulate_values for n <= G rows (G fixed at compile time so that the accumulators are registers).
template <int ND, int G>
inline void accumulate_rows(int64_t n, float* acc, const float* alpha, const float* probs, const float* const* vr,
                            int64_t nv) {
  if constexpr (G > 1) {
    if (n < G) return accumulate_rows<ND, G - 1>(n, acc, alpha, probs, vr, nv);
  }
  accumulate_values<ND, G>(acc, alpha, probs, vr, nv);
}

// "dot" path: few rows (decode and short prefills). Per row: 16 dot products reduced to one vector of scores;
// then the values of the chunk are accumulated for groups of rows together (accumulate_values).
template <int ND>
void attend_dot(const Problem& p, const Item& it, Scratch& s, float* partials) {
  constexpr int D = ND * 16;
  constexpr int kGroup = 16 / ND;  // rows whose accumulators fit in registers together
  const int64_t rows = item_rows(p, it);
  float* q = s.qbuf.get();
  float* acc = s.acc.get();
  float* m = s.m.get();
  float* l = s.l.get();
  const int32_t* pos = s.pos.data();
  start_tile(p, it, s, rows);
  const int32_t* table = p.bt + static_cast<int64_t>(it.r) * p.maxb;
  KeyCursor cur(table, p.bs, it.k0);
  Prefetcher pf(table, p.bs, it.k0);
  const float* kr[kChunk];
  const float* vr[kChunk];
  alignas(64) float probs[kMaxRows * kChunk];  // this chunk's softmax numerators, kChunk per query row
  alignas(64) float alpha[kMaxRows];           // per row: rescale of the accumulator for the new running max
  alignas(64) float kscale[kChunk], vscale[kChunk];  // int8 KV: the chunk's row scales (see chunk_rows)
  for (int64_t c = it.k0; c < it.k1; c += kChunk) {
    const int64_t nk = std::min<int64_t>(kChunk, it.k1 - c);
    pf.run<ND>(p, it.h, c, it.k1);
    chunk_rows<ND>(p, it.h, cur, nk, false, s.kbuf.get(), s.vbuf.get(), kr, vr, kscale, vscale);
    // int8 KV: score = (q . k_int) * k_scale; the values' scales go into the probabilities (not into l)
    const __m512 ksv = p.kv_int8 ? _mm512_load_ps(kscale) : _mm512_set1_ps(1.f);
    const __m512 vsv = p.kv_int8 ? _mm512_load_ps(vscale) : _mm512_set1_ps(1.f);
    int64_t nv_max = 0;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t nv = std::clamp<int64_t>(pos[i] - c + 1, 0, nk);  // causal: keys up to the row's position
      nv_max = std::max(nv_max, nv);
      if (nv == 0) {  // nothing visible in this chunk: the row's state stays as it is
        alpha[i] = 1.f;
        _mm512_store_ps(probs + i * kChunk, _mm512_setzero_ps());
        continue;
      }
      __m512 qv[ND];
      for (int e = 0; e < ND; ++e) qv[e] = _mm512_loadu_ps(q + i * D + e * 16);
      __m512 sacc[kChunk];
      for (int j = 0; j < kChunk; ++j) {
        __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr[j]));
        for (int e = 1; e < ND; ++e) a = _mm512_fmadd_ps(qv[e], _mm512_loadu_ps(kr[j] + e * 16), a);
        sacc[j] = a;
      }
      const __m512 sv = p.kv_int8 ? _mm512_mul_ps(reduce16(sacc), ksv) : reduce16(sacc);
      const __mmask16 km = static_cast<__mmask16>((1u << nv) - 1u);
      const float mn = std::max(m[i], _mm512_mask_reduce_max_ps(km, sv));
      alpha[i] = std::exp2(m[i] - mn);
      const __m512 pv = _mm512_maskz_mov_ps(km, exp2_ps(_mm512_sub_ps(sv, _mm512_set1_ps(mn))));
      l[i] = l[i] * alpha[i] + _mm512_reduce_add_ps(pv);
      m[i] = mn;
      _mm512_store_ps(probs + i * kChunk, p.kv_int8 ? _mm512_mul_ps(pv, vsv) : pv);
    }
    for (int64_t i = 0; i < rows; i += kGroup)
      accumulate_rows<ND, kGroup>(std::min<int64_t>(kGroup, rows - i), acc + i * D, alpha + i, probs + i * kChunk,
                                  vr, nv_max);
  }
  finish(p, it, acc, m, l, partials);
}

PA_INSTANTIATE(attend_dot)

}  // namespace pagedllm::attn
#endif
