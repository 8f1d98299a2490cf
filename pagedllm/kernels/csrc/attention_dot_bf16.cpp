// "dot" path for bf16 queries over a bf16 cache (decode and short prefills of bf16 models): the raw bf16 rows
// go straight into vdpbf16ps, nothing is widened. Scores: q . k with fp32 sums of exact bf16 products, scaled
// afterwards. Values: the probabilities of a pair of keys as bf16 pairs (high and low parts) and the two V rows
// interleaved, so one vdpbf16ps per part adds both keys into 16 fp32 accumulators. The interleave permutes dims
// within each 32-dim block (pair_dim); unpermute_rows undoes it.

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

// 16 scores of one query row against keys kr[0..15] + koff (unscaled, fp32 sums); prefetches the rows pf[j] + koff
// of the keys j = pf_first, pf_first + pf_step, ...
template <int NB>
inline __m512 scores16(const __m512bh* qv, const uint16_t* const* kr, int64_t koff, const uint16_t* const* pf,
                       int pf_step, int pf_first) {
  __m512 sacc[16];
  for (int j = 0; j < 16; ++j) {
    if (pf && j % pf_step == pf_first)
      for (int b = 0; b < NB; ++b) prefetch_line(pf[j] + koff + 32 * b);
    __m512 a = _mm512_setzero_ps();
    for (int b = 0; b < NB; ++b)
      a = _mm512_dpbf16_ps(a, qv[b], (__m512bh)_mm512_loadu_si512(kr[j] + koff + 32 * b));
    sacc[j] = a;
  }
  return reduce16(sacc);
}

// Probabilities p0 (keys 0-15), p1 (keys 16-31) as bf16 pairs (p[2k], p[2k+1]) in two parts, p ~= hi + lo to ~2^-17:
// both parts go through vdpbf16ps. One bf16 (8 bits) made a row's result depend on which path computed it (a
// prefix-cache hit prefills its tail on the dot path, a full prompt on the lanes path) enough to change seeded

template <int NB, int G>
inline void accumulate_pairs(float* acc, const float* alpha, const uint32_t* pp, const uint16_t* const* vr,
                             int64_t voff, int64_t npairs, const uint16_t* const* pf) {
  constexpr int D = NB * 32;
  __m512 a[G][2 * NB];
  for (int g = 0; g < G; ++g) {
    const __m512 al = _mm512_set1_ps(alpha[g]);
    for (int e = 0; e < 2 * NB; ++e) a[g][e] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + e * 16), al);
  }
  for (int64_t m = 0; m < npairs; ++m) {
    if (pf)
      for (int b = 0; b < NB; ++b) {
        prefetch_line(pf[2 * m] + voff + 32 * b);
        prefetch_line(pf[2 * m + 1] + voff + 32 * b);
      }
    __m512i v[2 * NB];
    for (int b = 0; b < NB; ++b) {
      const __m512i x = _mm512_loadu_si512(vr[2 * m] + voff + 32 * b);
      const __m512i y = _mm512_loadu_si512(vr[2 * m + 1] + voff + 32 * b);
      v[2 * b] = _mm512_unpacklo_epi16(x, y);
      v[2 * b + 1] = _mm512_unpackhi_epi16(x, y);
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[g * kPairChunk + m]));
      const __m512bh wl = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[g * kPairChunk + kPairChunk / 2 + m]));
      for (int e = 0; e < 2 * NB; ++e) a[g][e] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[g][e], w, (__m512bh)v[e]), wl,
                                                                  (__m512bh)v[e]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int e = 0; e < 2 * NB; ++e) _mm512_storeu_ps(acc + g * D + e * 16, a[g][e]);
}

template <int NB, int G>
inline void accumulate_pair_rows(int64_t n, float* acc, const float* alpha, const uint32_t* pp,
                                 const uint16_t* const* vr, int64_t voff, int64_t npairs, const uint16_t* const* pf) {
  if constexpr (G > 1) {
    if (n < G) return accumulate_pair_rows<NB, G - 1>(n, acc, alpha, pp, vr, voff, npairs, pf);
  }
  accumulate_pairs<NB, G>(acc, alpha, pp, vr, voff, npairs, pf);
}


// Rows of D accumulators back to natural dim order, one 32-dim block (two vectors) at a time: dim e of a block
// comes from the position q with pair_dim(q) = e.
template <int D>
inline void unpermute_rows(float* acc, int64_t rows) {
  alignas(64) int32_t from[32];
  for (int q = 0; q < 32; ++q) from[pair_dim(q)] = q;
  const __m512i first = _mm512_load_si512(from), second = _mm512_load_si512(from + 16);
  for (int64_t i = 0; i < rows * D / 32; ++i) {
    float* blk = acc + i * 32;
    const __m512 lo = _mm512_loadu_ps(blk), hi = _mm512_loadu_ps(blk + 16);
    _mm512_storeu_ps(blk, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(blk + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}

template <int ND>
void attend_dot_bf16(const Problem& p, const Item& it, Scratch& s, float* partials) {
  constexpr int D = ND * 16;
  constexpr int NB = ND / 2;        // 32-element bf16 vectors per row
  constexpr int kGroup = 16 / ND;   // rows whose accumulators fit in registers together
  constexpr int kPairs = kPairChunk / 2;
  const int64_t rows = item_rows(p, it);  // <= kMaxRows
  const int64_t per_head = rows / it.nh;
  const int64_t n_new = p.qsl[it.r + 1] - p.qsl[it.r];
  float* acc = s.acc.get();
  alignas(64) float m[kMaxRows], l[kMaxRows], alpha[kMaxRows], mnew[kMaxRows], psum[kMaxRows];
  alignas(64) uint32_t pp[kMaxRows * 2 * kPairs];  // per row: kPairs high parts, then kPairs low parts
  int32_t pos[kMaxRows];
  const uint16_t* qrow[kMaxRows];
  std::fill(m, m + kMaxRows, kNegInf);
  std::fill(mnew, mnew + kMaxRows, kNegInf);
  std::fill(l, l + kMaxRows, 0.f);
  std::fill(psum, psum + kMaxRows, 0.f);
  for (int64_t i = 0; i < rows; ++i) {
    const auto [t, head] = row_of(p, it, i);
    qrow[i] = static_cast<const uint16_t*>(p.q) + (p.qsl[it.r] + t) * p.q_tok_stride + head * p.q_head_stride;
    pos[i] = static_cast<int32_t>(p.seq_lens[it.r] - n_new + t);
  }
  std::fill(acc, acc + rows * D, 0.f);
  const __m512 qscale = _mm512_set1_ps(p.qscale);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const int32_t* table = p.bt + static_cast<int64_t>(it.r) * p.maxb;
  KeyCursor cur(table, p.bs, it.k0);
  const uint16_t* ptrs[4][kPairChunk];  // K and V rows of this chunk and of the next one
  const uint16_t **kr = ptrs[0], **vr = ptrs[1], **kn = ptrs[2], **vn = ptrs[3];
  chunk_ptrs(p, it.h, cur, std::min<int64_t>(kPairChunk, it.k1 - it.k0), kr, vr);
  FarPrefetcher far(table, p.bs, it, 2 * kPairChunk);  // chunk_ptrs below covers the next chunk
  for (int64_t c = it.k0; c < it.k1; c += kPairChunk) {
    const int64_t nk = std::min<int64_t>(kPairChunk, it.k1 - c);
    const bool has_next = c + kPairChunk < it.k1;
    far.run(p, it, c);
    // the next chunk's rows to prefetch: this item's, or in its last chunk the first ones of the thread's next item
    const Item* nx = s.next;
    const bool next_item = !has_next && nx && nx->nh == it.nh;
    if (has_next) {
      chunk_ptrs(p, it.h, cur, std::min<int64_t>(kPairChunk, it.k1 - c - kPairChunk), kn, vn);
    } else if (next_item) {
      KeyCursor ncur(p.bt + static_cast<int64_t>(nx->r) * p.maxb, p.bs, nx->k0);
      chunk_ptrs(p, nx->h, ncur, std::min<int64_t>(kPairChunk, nx->k1 - nx->k0), kn, vn);
    }
    const uint16_t* const* kpf = has_next || next_item ? kn : nullptr;
    const uint16_t* const* vpf = has_next || next_item ? vn : nullptr;
    int64_t nv_max = 0;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t nv = std::clamp<int64_t>(pos[i] - c + 1, 0, nk);  // causal: keys up to the row's position
      nv_max = std::max(nv_max, nv);
      const __mmask16 m0 = static_cast<__mmask16>(nv >= 16 ? 0xffffu : (1u << nv) - 1u);
      const __mmask16 m1 = static_cast<__mmask16>(nv >= 32 ? 0xffffu : nv > 16 ? (1u << (nv - 16)) - 1u : 0u);
      __m512bh qv[NB];
      for (int b = 0; b < NB; ++b) qv[b] = (__m512bh)_mm512_loadu_si512(qrow[i] + 32 * b);
      const int64_t koff = i / per_head * D;  // this row's KV head within the token row
      // the head's rows share the prefetch of its K rows of the next chunk: row g of the head takes the keys
      // j = g (mod rows of the head)
      const int step = static_cast<int>(per_head), g = static_cast<int>(i % per_head);
      const __m512 s0 = _mm512_mul_ps(scores16<NB>(qv, kr, koff, kpf, step, g), qscale);
      const __m512 s1 = nv > 16 ? _mm512_mul_ps(scores16<NB>(qv, kr + 16, koff, kpf ? kpf + 16 : nullptr, step,
                                                             ((g - 16) % step + step) % step),
                                                qscale)
                                : neg_inf;
      const __m512 smax = _mm512_max_ps(_mm512_mask_mov_ps(neg_inf, m0, s0), _mm512_mask_mov_ps(neg_inf, m1, s1));
      const float mn = std::max(m[i], _mm512_reduce_max_ps(smax));
      mnew[i] = mn;
      const __m512 mv = _mm512_set1_ps(mn == kNegInf ? 0.f : mn);
      const __m512 p0 = _mm512_maskz_mov_ps(m0, exp2_ps(_mm512_sub_ps(s0, mv)));
      const __m512 p1 = _mm512_maskz_mov_ps(m1, exp2_ps(_mm512_sub_ps(s1, mv)));
      psum[i] = _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      __m512i hi, lo;
      split_bf16_pairs(p0, p1, hi, lo);
      _mm512_store_si512(pp + i * 2 * kPairs, hi);
      _mm512_store_si512(pp + i * 2 * kPairs + kPairs, lo);
    }
    // all rows at once: alpha = 2^(m_old - m_new), 1 where both are -inf (no key seen yet)
    for (int64_t i = 0; i < rows; i += 16) {
      const __m512 mo = _mm512_load_ps(m + i), mw = _mm512_load_ps(mnew + i);
      const __m512 al = exp2_ps(_mm512_maskz_sub_ps(_mm512_cmp_ps_mask(mo, mw, _CMP_NEQ_OQ), mo, mw));
      _mm512_store_ps(alpha + i, al);
      _mm512_store_ps(l + i, _mm512_fmadd_ps(_mm512_load_ps(l + i), al, _mm512_load_ps(psum + i)));
      _mm512_store_ps(m + i, mw);
    }
    const int64_t npairs = (nv_max + 1) / 2;
    for (int64_t hh = 0; hh < it.nh; ++hh)
      for (int64_t i = hh * per_head; i < (hh + 1) * per_head; i += kGroup)
        accumulate_pair_rows<NB, kGroup>(std::min<int64_t>(kGroup, (hh + 1) * per_head - i), acc + i * D,
                                         alpha + i, pp + i * 2 * kPairs, vr, hh * D, npairs,
                                         i == hh * per_head ? vpf : nullptr);  // one prefetching group per head
    std::swap(kr, kn);
    std::swap(vr, vn);
  }
  unpermute_rows<D>(acc, rows);
  finish(p, it, acc, m, l, partials);
}

PA_INSTANTIATE(attend_dot_bf16)

}  // namespace pagedllm::attn
#endif
