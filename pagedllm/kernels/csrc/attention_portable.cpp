// Portable path: plain loops, one row at a time over chunks of keys (no AVX-512 in the build, head dims other
// than 32/64/128/256, or asked for).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention.h"


namespace pagedllm::attn {

using pagedllm::bf16_to_f32;
using pagedllm::f32_to_bf16;

void attend_portable(const Problem& p, const Item& it, Scratch& s, float* partials) {
  const int64_t d = p.d;
  const int64_t rows = item_rows(p, it);
  float* q = s.qbuf.get();
  float* acc = s.acc.get();
  float* m = s.m.get();
  float* l = s.l.get();
  start_tile(p, it, s, rows);
  const int32_t* table = p.bt + static_cast<int64_t>(it.r) * p.maxb;
  KeyCursor cur(table, p.bs, it.k0);
  float* kb = s.kbuf.get();
  float* vb = s.vbuf.get();
  float sc[kChunk];
  for (int64_t c = it.k0; c < it.k1; c += kChunk) {
    const int64_t nk = std::min<int64_t>(kChunk, it.k1 - c);
    for (int64_t j = 0; j < nk; ++j, cur.next()) {
      const int64_t off = cur.slot() * p.kv_tok_stride + it.h * p.kv_head_stride;
      if (p.kv_int8) {
        const int8_t* ks = static_cast<const int8_t*>(p.kc) + off;
        const int8_t* vs = static_cast<const int8_t*>(p.vc) + off;
        const float sk = int8_row_scale(ks, d), sv = int8_row_scale(vs, d);
        for (int64_t e = 0; e < d; ++e) {
          kb[j * d + e] = static_cast<float>(ks[e]) * sk;
          vb[j * d + e] = static_cast<float>(vs[e]) * sv;
        }
      } else if (p.kv_bf16) {
        const uint16_t* ks = static_cast<const uint16_t*>(p.kc) + off;
        const uint16_t* vs = static_cast<const uint16_t*>(p.vc) + off;
        for (int64_t e = 0; e < d; ++e) {
          kb[j * d + e] = bf16_to_f32(ks[e]);
          vb[j * d + e] = bf16_to_f32(vs[e]);
        }
      } else {
        std::memcpy(kb + j * d, static_cast<const float*>(p.kc) + off, d * sizeof(float));
        std::memcpy(vb + j * d, static_cast<const float*>(p.vc) + off, d * sizeof(float));
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t nv = std::min<int64_t>(nk, s.pos[i] - c + 1);  // causal: keys up to the row's position
      if (nv <= 0) continue;
      float mc = kNegInf;
      for (int64_t j = 0; j < nv; ++j) {
        float dot = 0.f;
        const float* qi = q + i * d;
        const float* kj = kb + j * d;
#pragma omp simd reduction(+ : dot)
        for (int64_t e = 0; e < d; ++e) dot += qi[e] * kj[e];
        sc[j] = dot;
        mc = std::max(mc, dot);
      }
      const float mn = std::max(m[i], mc);
      const float alpha = std::exp2(m[i] - mn);
      float* ai = acc + i * d;
      float lsum = 0.f;
      for (int64_t e = 0; e < d; ++e) ai[e] *= alpha;
      for (int64_t j = 0; j < nv; ++j) {
        const float pj = std::exp2(sc[j] - mn);
        lsum += pj;
        const float* vj = vb + j * d;
        for (int64_t e = 0; e < d; ++e) ai[e] += pj * vj[e];
      }
      l[i] = l[i] * alpha + lsum;
      m[i] = mn;
    }
  }
  finish(p, it, acc, m, l, partials);
}

}  // namespace pagedllm::attn
