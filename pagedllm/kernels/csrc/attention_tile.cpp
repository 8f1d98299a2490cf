// Tiles in and out: the queries of a tile into the scratch, a finished tile into out (or into the partials of a
// context slice), and the merge of a tile's slices.

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

// Query rows of a tile: row i = token (t0 + i / group), head (h * group + i % group); scaled, fp32.
void load_queries(const Problem& p, const Item& it, float* qbuf, int32_t* pos) {
  const int64_t n = p.qsl[it.r + 1] - p.qsl[it.r];
  const int64_t ctx_start = p.seq_lens[it.r] - n;
  const int64_t rows = item_rows(p, it);
  for (int64_t i = 0; i < rows; ++i) {
    const auto [t, head] = row_of(p, it, i);
    const int64_t off = (p.qsl[it.r] + t) * p.q_tok_stride + head * p.q_head_stride;
    float* dst = qbuf + i * p.d;
    if (p.q_bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(p.q) + off;
      for (int64_t e = 0; e < p.d; ++e) dst[e] = bf16_to_f32(src[e]) * p.qscale;
    } else {
      const float* src = static_cast<const float*>(p.q) + off;
      for (int64_t e = 0; e < p.d; ++e) dst[e] = src[e] * p.qscale;
    }
    pos[i] = static_cast<int32_t>(ctx_start + t);
  }
}

// A tile's queries into the scratch, its online-softmax state (acc, m, l) empty.
void start_tile(const Problem& p, const Item& it, Scratch& s, int64_t rows) {
  load_queries(p, it, s.qbuf.get(), s.pos.data());
  std::fill(s.acc.get(), s.acc.get() + rows * p.d, 0.f);
  std::fill(s.m.get(), s.m.get() + rows, kNegInf);
  std::fill(s.l.get(), s.l.get() + rows, 0.f);
}

// Writes a finished tile: normalised rows into out (the sink, if any, joining the denominator), or the
// unnormalised (m, l, acc) of a context slice.
void finish(const Problem& p, const Item& it, const float* acc, const float* m, const float* l, float* partials) {
  const int64_t rows = item_rows(p, it);
  if (it.part >= 0) {
    float* dst = partials + it.part;
    std::memcpy(dst, m, rows * sizeof(float));
    std::memcpy(dst + rows, l, rows * sizeof(float));
    std::memcpy(dst + 2 * rows, acc, rows * p.d * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < rows; ++i) {
    const auto [t, head] = row_of(p, it, i);
    const int64_t off = ((p.qsl[it.r] + t) * p.hq + head) * p.d;
    const float denom = l[i] + sink_weight(p, head, m[i]);
    const float inv = denom > 0.f ? 1.f / denom : 0.f;
    const float* a = acc + i * p.d;
    if (p.q_bf16) {
      uint16_t* o = static_cast<uint16_t*>(p.out) + off;
      int64_t e = 0;
#if PL_AVX512_BF16
      const __m512 vinv = _mm512_set1_ps(inv);
      for (; e + 16 <= p.d; e += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(a + e), vinv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + e), reinterpret_cast<const __m256i&>(h));
      }
#endif
      for (; e < p.d; ++e) o[e] = f32_to_bf16(a[e] * inv);
    } else {
      float* o = static_cast<float*>(p.out) + off;
      for (int64_t e = 0; e < p.d; ++e) o[e] = a[e] * inv;
    }
  }
}

// Merge the context slices of one tile: out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s.
void merge(const Problem& p, const Item* slices, int64_t nslices, const float* partials) {
  const Item& it = slices[0];
  const int64_t rows = item_rows(p, it);
  std::vector<float> acc(rows * p.d, 0.f), m(rows, kNegInf), l(rows, 0.f);
  for (int64_t i = 0; i < rows; ++i) {
    float mx = kNegInf;
    for (int64_t k = 0; k < nslices; ++k) mx = std::max(mx, partials[slices[k].part + i]);
    if (mx == kNegInf) continue;
    for (int64_t k = 0; k < nslices; ++k) {
      const float* part = partials + slices[k].part;
      const float w = std::exp2(part[i] - mx);
      if (w == 0.f) continue;
      l[i] += w * part[rows + i];
      const float* a = part + 2 * rows + i * p.d;
      for (int64_t e = 0; e < p.d; ++e) acc[i * p.d + e] += w * a[e];
    }
    m[i] = mx;
  }
  Item direct = it;
  direct.part = -1;
  finish(p, direct, acc.data(), m.data(), l.data(), nullptr);
}


}  // namespace pagedllm::attn
