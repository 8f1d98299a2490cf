// AVX-512 helpers of the vector paths (attention_dot*.cpp, attention_lanes*.cpp).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention.h"

namespace pagedllm::attn {

inline __m512 exp2_ps(__m512 x) {  // 2^x, rel. error ~1e-7; x <= -126 gives ~0 (callers mask exact zeros)
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  x = _mm512_min_ps(x, _mm512_set1_ps(126.f));
  const __m512 xi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, xi);  // [-0.5, 0.5]
  __m512 y = _mm512_set1_ps(1.5403530393381606e-4f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558146428443e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076284772e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108664821580e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650695910071e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718055994531e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, xi);
}

using pagedllm::load_bf16;

inline __m512 load_int8(const int8_t* src) {  // 16 int8 values as fp32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}


inline __m512 load_row16(const float* r) { return _mm512_loadu_ps(r); }
inline __m512 load_row16(const int8_t* r) { return load_int8(r); }

// Row pointers (fp32) of the next chunk of keys; bf16 rows are widened into kb/vb. Missing keys (past k1) point
// at the first row so that fixed 16-wide loops stay in bounds (their scores are masked).
// int8 rows are widened into kb/vb too: scaled here when kscale/vscale are null (the lanes path), else unscaled,
// with the 16 rows' scales stored into kscale/vscale (0 for missing keys) for the caller to apply to the scores
// and probabilities (the dot path: one multiply per key instead of one per element).
template <int ND>
inline void chunk_rows(const Problem& p, int64_t h, KeyCursor& cur, int64_t nk, bool pack, float* kb, float* vb,
                       const float** kr, const float** vr, float* kscale = nullptr, float* vscale = nullptr) {
  constexpr int D = ND * 16;
  alignas(32) uint16_t ksh[kChunk] = {}, vsh[kChunk] = {};  // the rows' float16 scales
  for (int64_t j = 0; j < nk; ++j, cur.next()) {
    const int64_t off = cur.slot() * p.kv_tok_stride + h * p.kv_head_stride;
    if (p.kv_int8) {
      const int8_t* ks = static_cast<const int8_t*>(p.kc) + off;
      const int8_t* vs = static_cast<const int8_t*>(p.vc) + off;
      std::memcpy(&ksh[j], ks + D, sizeof(uint16_t));
      std::memcpy(&vsh[j], vs + D, sizeof(uint16_t));
      if (kscale != nullptr) {
        for (int c = 0; c < ND; ++c) {
          _mm512_store_ps(kb + j * D + c * 16, load_int8(ks + c * 16));
          _mm512_store_ps(vb + j * D + c * 16, load_int8(vs + c * 16));
        }
      } else {
        const __m512 sk = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(ksh[j])));
        const __m512 sv = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(vsh[j])));
        for (int c = 0; c < ND; ++c) {
          _mm512_store_ps(kb + j * D + c * 16, _mm512_mul_ps(load_int8(ks + c * 16), sk));
          _mm512_store_ps(vb + j * D + c * 16, _mm512_mul_ps(load_int8(vs + c * 16), sv));
        }
      }
      kr[j] = kb + j * D;
      vr[j] = vb + j * D;
    } else if (p.kv_bf16) {
      const uint16_t* ks = static_cast<const uint16_t*>(p.kc) + off;
      const uint16_t* vs = static_cast<const uint16_t*>(p.vc) + off;
      for (int c = 0; c < ND; ++c) {
        _mm512_store_ps(kb + j * D + c * 16, load_bf16(ks + c * 16));
        _mm512_store_ps(vb + j * D + c * 16, load_bf16(vs + c * 16));
      }
      kr[j] = kb + j * D;
      vr[j] = vb + j * D;
    } else {
      const float* ks = static_cast<const float*>(p.kc) + off;
      const float* vs = static_cast<const float*>(p.vc) + off;
      if (pack) {  // contiguous copy: one base register for 16 broadcast rows
        for (int c = 0; c < ND; ++c) _mm512_store_ps(kb + j * D + c * 16, _mm512_loadu_ps(ks + c * 16));
        kr[j] = kb + j * D;
      } else {
        kr[j] = ks;
      }
      vr[j] = vs;
    }
  }
  for (int64_t j = nk; j < kChunk; ++j) {
    kr[j] = kr[0];
    vr[j] = vr[0];
  }
  if (p.kv_int8 && kscale != nullptr) {
    _mm512_store_ps(kscale, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ksh))));
    _mm512_store_ps(vscale, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(vsh))));
  }
}

// Software prefetch of the K/V rows ahead of the chunk being computed: the block table scatters the rows, so the
// hardware prefetcher cannot follow across blocks.
#ifndef PA_PREFETCH_CHUNKS
#define PA_PREFETCH_CHUNKS 1
#endif

// Every cache line of the rows of KV heads it.h .. it.h + it.nh - 1 (adjacent in a token's row) of the key at
// cur, into L1 or (to_l2) L2. The prefetches are volatile asm: GCC 12 deleted this loop, whose only effect is
// prefetching, when it was written with _mm_prefetch under a branch or a template argument.
inline void prefetch_key_rows(const Problem& p, const Item& it, const KeyCursor& cur, bool to_l2) {
  const int64_t esz = p.kv_int8 ? 1 : p.kv_bf16 ? 2 : 4;
  const int64_t off = (cur.slot() * p.kv_tok_stride + it.h * p.kv_head_stride) * esz;
  const char* k = static_cast<const char*>(p.kc) + off;
  const char* v = static_cast<const char*>(p.vc) + off;
  // the lines from k's to the row's last byte's: as many as 64-byte steps from k cover (k need not be aligned)
  const int64_t span = it.nh * p.kv_head_stride * esz + static_cast<int64_t>(reinterpret_cast<uintptr_t>(k) & 63);
  for (int64_t b = 0; b < span; b += 64) {
    if (to_l2) {
      asm volatile("prefetcht1 %0" : : "m"(k[b]));
      asm volatile("prefetcht1 %0" : : "m"(v[b]));
    } else {
      asm volatile("prefetcht0 %0" : : "m"(k[b]));
      asm volatile("prefetcht0 %0" : : "m"(v[b]));
    }
  }
}

struct Prefetcher {
  static constexpr int64_t kLeadKeys = (1 + PA_PREFETCH_CHUNKS) * kChunk;  // up to key c + kLeadKeys
  KeyCursor cur;
  int64_t next;  // next key to prefetch
  Prefetcher(const int32_t* table, int64_t bs, int64_t k0) : cur(table, bs, k0), next(k0) {}
  // Prefetches the keys up to the chunk after the one starting at key c, at most max_keys of them.
  inline void run(const Problem& p, const Item& it, int64_t c, int64_t max_keys = kLeadKeys) {
    const int64_t target = std::min<int64_t>({it.k1, c + kLeadKeys, next + max_keys});
    for (; next < target; ++next, cur.next()) prefetch_key_rows(p, it, cur, false);
  }
};

// The keys further ahead, into L2: a long context streams from memory, and the one chunk of lead that the
// prefetch into L1 has is shorter than the memory's latency. Starts where the path's own prefetch stops, `near`
// keys into the item.
struct FarPrefetcher {
  static constexpr int64_t kLeadKeys = 96;  // prefetched up to key c + kLeadKeys while the chunk at c runs
  KeyCursor cur;
  int64_t next;
  FarPrefetcher(const int32_t* table, int64_t bs, const Item& it, int64_t near)
      : cur(table, bs, std::min<int64_t>(it.k1, it.k0 + near)), next(std::min<int64_t>(it.k1, it.k0 + near)) {}
  inline void run(const Problem& p, const Item& it, int64_t c) {
    for (const int64_t target = std::min<int64_t>(it.k1, c + kLeadKeys); next < target; ++next, cur.next())
      prefetch_key_rows(p, it, cur, true);
  }
};

// acc[g] = acc[g] * alpha[g] + sum_j p[g][j] * V[j] for the G rows of one group: all G x ND accumulators stay in
// registers and each V row (fp32, or int8 widened in registers) is loaded once for the whole group.
template <int ND, int G, typename Row>
inline void accumulate_values(float* acc, const float* alpha, const float* probs, const Row* const* vr, int64_t nv) {
  constexpr int D = ND * 16;
  __m512 a[G][ND];
  for (int g = 0; g < G; ++g) {
    const __m512 al = _mm512_set1_ps(alpha[g]);
    for (int e = 0; e < ND; ++e) a[g][e] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + e * 16), al);
  }
  for (int64_t j = 0; j < nv; ++j) {
    __m512 v[ND];
    for (int e = 0; e < ND; ++e) v[e] = load_row16(vr[j] + e * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 pj = _mm512_set1_ps(probs[g * kChunk + j]);
      for (int e = 0; e < ND; ++e) a[g][e] = _mm512_fmadd_ps(pj, v[e], a[g][e]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int e = 0; e < ND; ++e) _mm512_storeu_ps(acc + g * D + e * 16, a[g][e]);
}

// accumulate_values for n <= G rows (G fixed at compile time so that the accumulators are registers).
template <int ND, int G, typename Row>
inline void accumulate_rows(int64_t n, float* acc, const float* alpha, const float* probs, const Row* const* vr,
                            int64_t nv) {
  if constexpr (G > 1) {
    if (n < G) return accumulate_rows<ND, G - 1>(n, acc, alpha, probs, vr, nv);
  }
  accumulate_values<ND, G>(acc, alpha, probs, vr, nv);
}

// One row's online-softmax step over a chunk of keys: its 16 scores (base 2), of which the first nv are visible.
// Updates the running max m and sum l; returns the probabilities (0 past nv) and sets alpha, the rescale of the
// row's accumulator.
inline __m512 softmax_step(__m512 sv, int64_t nv, float& m, float& l, float& alpha) {
  const __mmask16 km = static_cast<__mmask16>((1u << nv) - 1u);
  const float mn = std::max(m, _mm512_mask_reduce_max_ps(km, sv));
  alpha = std::exp2(m - mn);
  const __m512 pv = _mm512_maskz_mov_ps(km, exp2_ps(_mm512_sub_ps(sv, _mm512_set1_ps(mn))));
  l = l * alpha + _mm512_reduce_add_ps(pv);
  m = mn;
  return pv;
}

// The fp32 dot path (few rows: decode and short prefills; attention_dot.cpp), over a Chunk that loads 16 keys of
// the item's KV heads at a time and gives each row's 16 scores (base 2) and, per head, the probabilities' scale and
// the value rows. Per row: scores, online softmax; then the values of the chunk accumulated for groups of rows of
// one head together. (The int8 dot path runs its own loop: p . V on integers, rows in groups.)
template <int ND, typename Chunk>
void attend_dot_chunks(const Problem& p, const Item& it, Scratch& s, float* partials) {
  constexpr int D = ND * 16;
  constexpr int kGroup = 16 / ND;  // rows whose accumulators fit in registers together
  const int64_t rows = item_rows(p, it);
  float* acc = s.acc.get();
  float* m = s.m.get();
  float* l = s.l.get();
  const int32_t* pos = s.pos.data();
  start_tile(p, it, s, rows);
  const int32_t* table = p.bt + static_cast<int64_t>(it.r) * p.maxb;
  KeyCursor cur(table, p.bs, it.k0);
  Prefetcher pf(table, p.bs, it.k0);
  FarPrefetcher far(table, p.bs, it, Prefetcher::kLeadKeys);
  const int64_t per_head = rows / it.nh;
  Chunk chunk(p, it, s, rows);
  alignas(64) float probs[kMaxRows * kChunk];  // this chunk's softmax numerators, kChunk per query row
  alignas(64) float alpha[kMaxRows];           // per row: rescale of the accumulator for the new running max
  for (int64_t c = it.k0; c < it.k1; c += kChunk) {
    const int64_t nk = std::min<int64_t>(kChunk, it.k1 - c);
    far.run(p, it, c);
    pf.run(p, it, c, 2);  // the next chunk's keys a few at a time, spread over the rows (a burst stalls the loop)
    chunk.load(cur, nk);
    int64_t nv_max = 0;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t nv = std::clamp<int64_t>(pos[i] - c + 1, 0, nk);  // causal: keys up to the row's position
      nv_max = std::max(nv_max, nv);
      if (nv == 0) {  // nothing visible in this chunk: the row's state stays as it is
        alpha[i] = 1.f;
        _mm512_store_ps(probs + i * kChunk, _mm512_setzero_ps());
        continue;
      }
      pf.run(p, it, c, 2);
      const int64_t hh = i / per_head;
      const __m512 pv = softmax_step(chunk.scores(i, hh), nv, m[i], l[i], alpha[i]);
      _mm512_store_ps(probs + i * kChunk, _mm512_mul_ps(pv, chunk.prob_scale(hh)));  // int8 V: its scales, else 1
    }
    pf.run(p, it, c);
    for (int64_t hh = 0; hh < it.nh; ++hh)
      for (int64_t i = hh * per_head; i < (hh + 1) * per_head; i += kGroup)
        accumulate_rows<ND, kGroup>(std::min<int64_t>(kGroup, (hh + 1) * per_head - i), acc + i * D, alpha + i,
                                    probs + i * kChunk, chunk.values(hh), nv_max);
  }
  finish(p, it, acc, m, l, partials);
}

#if PL_AVX512_BF16
constexpr int kPairChunk = 32;  // keys per online-softmax step of the bf16 dot path

// Raw bf16 row pointers of the next nk keys; missing keys (past the context) point at the first row.
inline void chunk_ptrs(const Problem& p, int64_t h, KeyCursor& cur, int64_t nk, const uint16_t** kr,
                       const uint16_t** vr) {
  const uint16_t* kc = static_cast<const uint16_t*>(p.kc) + h * p.d;  // first head of the item
  const uint16_t* vc = static_cast<const uint16_t*>(p.vc) + h * p.d;
  for (int64_t j = 0; j < nk; ++j, cur.next()) {
    const int64_t off = cur.slot() * p.kv_tok_stride;
    kr[j] = kc + off;
    vr[j] = vc + off;
  }
  for (int64_t j = nk; j < kPairChunk; ++j) {
    kr[j] = kr[0];
    vr[j] = vr[0];
  }
}

// Prefetch of one cache line of the next chunk. The prefetches are spread over the chunk's work (each query row
// fetches a share of its KV head's K rows while computing scores, the first value group of a head its V rows),
// not issued as one burst: a burst of hundreds of lines fills the core's miss buffers and stalls the loop until
// they arrive (`pagedllm bench kernel --dtype bfloat16` measures the decode path).
// NTA: the lines are read once, they should not evict the chunk being computed from L1.
inline void prefetch_line(const uint16_t* a) { _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_NTA); }


// samples; with the low part the paths differ about as little as fp32 ones.
inline void split_bf16_pairs(__m512 p0, __m512 p1, __m512i& hi, __m512i& lo) {
  const __m256bh h0 = _mm512_cvtneps_pbh(p0), h1 = _mm512_cvtneps_pbh(p1);
  const __m512 r0 = _mm512_sub_ps(p0, pagedllm::widen_bf16((__m256i)h0));
  const __m512 r1 = _mm512_sub_ps(p1, pagedllm::widen_bf16((__m256i)h1));
  hi = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)h0), (__m256i)h1, 1);
  lo = (__m512i)_mm512_cvtne2ps_pbh(r1, r0);
}

// acc[g] = acc[g] * alpha[g] + sum_j p[g][j] V[j] for G rows, keys taken in pairs (pp: per row, kPairChunk / 2

// Dim held at position q of an accumulator row whose V pairs were interleaved by unpacklo/hi_epi16 per 32-dim
// block: the low half of the block has dims 8k..8k+3 in 128-bit lane k, the high half 8k+4..8k+7.
constexpr int pair_dim(int q) { return q / 32 * 32 + (q % 16) / 4 * 8 + (q % 32) / 16 * 4 + q % 4; }

#endif  // __AVX512BF16__

// Online softmax step of the lanes paths for 16 rows (lanes) and the chunk's keys c .. c + nk - 1: masks keys
// after each row's position, updates the running max m and sum l, turns the (scaled) scores s[j] into the
// probabilities and returns the rescale factor of the rows' accumulators.
inline __m512 lanes_softmax(__m512* s, const int32_t* pos, int64_t c, int64_t nk, __m512& m, __m512& l) {
  const __m512i posv = _mm512_loadu_si512(pos);
  __mmask16 vm[kChunk];
  __m512 mb = _mm512_set1_ps(kNegInf);
  for (int j = 0; j < kChunk; ++j) {
    vm[j] = j < nk ? _mm512_cmp_epi32_mask(posv, _mm512_set1_epi32(static_cast<int32_t>(c + j)), _MM_CMPINT_NLT)
                   : static_cast<__mmask16>(0);
    mb = _mm512_mask_max_ps(mb, vm[j], mb, s[j]);
  }
  const __m512 mn = _mm512_max_ps(m, mb);
  // rows with no valid key yet keep m = -inf; use 0 there so that exp2 sees no inf - inf
  const __m512 mu = _mm512_mask_mov_ps(mn, _mm512_cmp_ps_mask(mn, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ),
                                       _mm512_setzero_ps());
  const __m512 alpha = exp2_ps(_mm512_sub_ps(m, mu));
  __m512 lsum = _mm512_setzero_ps();
  for (int j = 0; j < kChunk; ++j) {
    s[j] = _mm512_maskz_mov_ps(vm[j], exp2_ps(_mm512_sub_ps(s[j], mu)));
    lsum = _mm512_add_ps(lsum, s[j]);
  }
  l = _mm512_fmadd_ps(l, alpha, lsum);
  m = mn;
  return alpha;
}

// The end of a lanes tile: each row's running max and sum out of their vectors, the transposed accumulator
// ([D][rows padded to 16], position q holding dim dim_of(q)) back to rows, then finish.
template <int D, typename DimOf>
void finish_lanes(const Problem& p, const Item& it, Scratch& s, const __m512* mv, const __m512* lv, const float* accT,
                  float* partials, DimOf dim_of) {
  const int64_t rows = item_rows(p, it);
  const int64_t nvec = (rows + 15) / 16, mp = nvec * 16;
  float* acc = s.acc.get();
  float* m = s.m.get();
  float* l = s.l.get();
  for (int v = 0; v < nvec; ++v) {
    _mm512_storeu_ps(m + v * 16, mv[v]);
    _mm512_storeu_ps(l + v * 16, lv[v]);
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int q = 0; q < D; ++q) acc[i * D + dim_of(q)] = accT[q * mp + i];
  finish(p, it, acc, m, l, partials);
}

// "lanes" path: >= 16 rows (prefill). Rows sit in vector lanes: Q and the accumulator are kept transposed

}  // namespace pagedllm::attn
