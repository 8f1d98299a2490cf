// "lanes" path (fp32 arithmetic): >= kLanesMinRows query rows (prefill).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention.h"

#if PL_AVX512
#include "attention_avx512.h"

namespace pagedllm::attn {

using pagedllm::bf16_to_f32;
using pagedllm::f32_to_bf16;

template <int ND>
void attend_lanes(const Problem& p, const Item& it, Scratch& s, float* partials) {
  constexpr int D = ND * 16;
  const int64_t rows = item_rows(p, it);
  const int64_t nvec = (rows + 15) / 16;
  const int64_t mp = nvec * 16;
  float* q = s.qbuf.get();
  float* qt = s.acc.get();  // transposed queries [D][mp]; acc is reused for the row-major result at the end
  float* accT = s.accT.get();
  int32_t* pos = s.pos.data();
  load_queries(p, it, q, pos);
  for (int64_t i = rows; i < mp; ++i) pos[i] = pos[rows - 1];  // padding rows: finite, never stored
  for (int64_t e = 0; e < D; ++e)
    for (int64_t i = 0; i < mp; ++i) qt[e * mp + i] = i < rows ? q[i * D + e] : 0.f;
  std::fill(accT, accT + D * mp, 0.f);
  __m512 mv[kMaxRows / 16], lv[kMaxRows / 16];
  for (int v = 0; v < nvec; ++v) {
    mv[v] = _mm512_set1_ps(kNegInf);
    lv[v] = _mm512_setzero_ps();
  }
  const int32_t* table = p.bt + static_cast<int64_t>(it.r) * p.maxb;
  KeyCursor cur(table, p.bs, it.k0);
  Prefetcher pf(table, p.bs, it.k0);
  const float* kr[kChunk];
  const float* vr[kChunk];
  float* kb = s.kbuf.get();
  for (int64_t c = it.k0; c < it.k1; c += kChunk) {
    const int64_t nk = std::min<int64_t>(kChunk, it.k1 - c);
    pf.run(p, it, c);
    chunk_rows<ND>(p, it.h, cur, nk, true, kb, s.vbuf.get(), kr, vr);
    for (int v = 0; v < nvec; ++v) {
      if (pos[v * 16 + 15] < c) continue;  // positions grow with the row: every row of v is before this chunk
      __m512 sacc[kChunk];
      for (int j = 0; j < kChunk; ++j) sacc[j] = _mm512_setzero_ps();
      for (int e = 0; e < D; ++e) {
        const __m512 qd = _mm512_loadu_ps(qt + e * mp + v * 16);
        for (int j = 0; j < kChunk; ++j) sacc[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kb[j * D + e]), sacc[j]);
      }
      const __m512 alpha = lanes_softmax(sacc, pos + v * 16, c, nk, mv[v], lv[v]);
      for (int e0 = 0; e0 < D; e0 += 8) {
        __m512 a[8];
        for (int e = 0; e < 8; ++e) a[e] = _mm512_mul_ps(_mm512_loadu_ps(accT + (e0 + e) * mp + v * 16), alpha);
        for (int j = 0; j < kChunk; ++j)
          for (int e = 0; e < 8; ++e) a[e] = _mm512_fmadd_ps(sacc[j], _mm512_set1_ps(vr[j][e0 + e]), a[e]);
        for (int e = 0; e < 8; ++e) _mm512_storeu_ps(accT + (e0 + e) * mp + v * 16, a[e]);
      }
    }
  }
  finish_lanes<D>(p, it, s, mv, lv, accT, partials, [](int q) { return q; });
}

PA_INSTANTIATE(attend_lanes)

}  // namespace pagedllm::attn
#endif
