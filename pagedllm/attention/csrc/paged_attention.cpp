// Paged attention on the CPU: reads K/V blocks in place through block tables.
//
// One work item = (request, KV head, tile of new tokens, slice of the context). All query heads of the KV head's
// group are handled together, so each K/V row is read once per tile for the whole group (GQA-aware). Softmax is
// online over chunks of keys; slices of a long context are merged at the end (flash-decoding style).
//
// Three inner loops, all with fp32 accumulators:
//   * "dot" path (few query rows, e.g. decode): 16 dot products per row, reduced into one vector of 16 scores;
//     bf16 K/V are widened when loaded;
//   * "bf16 dot" path (the same rows when q and the cache are both bf16 and the CPU has AVX512-BF16): the bf16
//     rows go straight into vdpbf16ps, and an item takes all KV heads of the request (whole K/V token rows, read
//     as one stream per block; see one_item_per_token_row), with prefetches spread over the chunk's work;
//   * "lanes" path (>= 16 query rows, prefill): query rows live in vector lanes, K/V elements are broadcast, so
//     the row max / rescale of the online softmax are plain vertical vector ops; with bf16 q and cache on an
//     AVX512-BF16 CPU, pairs of bf16 elements are broadcast into vdpbf16ps instead (attend_lanes_bf16).
// The bf16 paths multiply V by the softmax probabilities split into a high and a low bf16 part (split_bf16_pairs);
// sums stay fp32.
// They need AVX-512 (compiled with -mavx512* when the CPU has it, see cpu_kernel.py); the portable path is plain
// C++ and is used when the build lacks AVX-512, for head dims other than 32/64/128, or on request. With
// AVX512-BF16 the bf16 outputs are rounded by vcvtne2ps2bf16/vcvtneps2bf16.
//
// Scores are computed in base 2: q is pre-multiplied by scale * log2(e) (the bf16 paths multiply the fp32 sum
// instead) and exp2 replaces exp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define PA_AVX512 1
#else
#define PA_AVX512 0
#endif

namespace {

using pagedllm::bf16_to_f32;
using pagedllm::f32_to_bf16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kChunk = 16;     // keys per online-softmax step
constexpr int kMaxRows = 64;   // query rows (tokens x group heads) per tile
constexpr int64_t kMinWorkPerThread = 1 << 13;  // (key x row) pairs, ~60 us of one thread

struct Problem {
  const void* q;
  void* out;
  const void* kc;
  const void* vc;
  const int32_t* bt;
  const int32_t* seq_lens;
  const int32_t* qsl;
  int64_t hq, hkv, group, d, bs, maxb;
  int64_t q_tok_stride, q_head_stride;  // elements
  int64_t kv_tok_stride;                // hkv * d
  float qscale;                         // scale * log2(e)
  bool q_bf16, kv_bf16;                 // out has q's dtype
};

struct Item {
  int32_t r, h, t0, t1;  // request, first KV head, new tokens [t0, t1) of the request
  int32_t k0, k1;        // keys [k0, k1) of the context
  int64_t part;          // offset of this slice's partial result in the partials buffer, -1 = write out directly
  int32_t nh = 1;        // KV heads h .. h + nh - 1 (more than one on the bf16 decode path only)
};

// Query rows of an item, head-major: row i = KV head h + i / per_head, token t0 + (i % per_head) / group, query
// head (h + i / per_head) * group + i % group.
inline int64_t item_rows(const Problem& p, const Item& it) {
  return static_cast<int64_t>(it.t1 - it.t0) * p.group * it.nh;
}

// (token, query head) of row i.
inline std::pair<int64_t, int64_t> row_of(const Problem& p, const Item& it, int64_t i) {
  const int64_t per_head = static_cast<int64_t>(it.t1 - it.t0) * p.group;
  const int64_t hh = i / per_head, rem = i % per_head;
  return {it.t0 + rem / p.group, (it.h + hh) * p.group + rem % p.group};
}

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Buf = std::unique_ptr<float[], FreeDeleter>;

inline Buf alloc_floats(size_t n) {
  size_t bytes = ((n * sizeof(float) + 63) / 64) * 64;
  return Buf(static_cast<float*>(std::aligned_alloc(64, bytes)));
}

// Per-thread scratch, sized for the largest tile.
struct Scratch {
  Buf qbuf, acc, accT, m, l, kbuf, vbuf;
  std::vector<int32_t> pos;
  const Item* next = nullptr;  // the item this thread takes next (the bf16 dot path prefetches its first keys)
  explicit Scratch(int64_t d)
      : qbuf(alloc_floats(kMaxRows * d)), acc(alloc_floats(kMaxRows * d)), accT(alloc_floats(kMaxRows * d)),
        m(alloc_floats(kMaxRows)), l(alloc_floats(kMaxRows)), kbuf(alloc_floats(kChunk * d)),
        vbuf(alloc_floats(kChunk * d)), pos(kMaxRows) {}
};

// Walks the context of one request one key at a time without a division per key.
struct KeyCursor {
  const int32_t* table;
  int64_t bs, blk, off;
  KeyCursor(const int32_t* t, int64_t block_size, int64_t key)
      : table(t), bs(block_size), blk(key / block_size), off(key % block_size) {}
  int64_t slot() const { return static_cast<int64_t>(table[blk]) * bs + off; }
  void next() {
    if (++off == bs) {
      off = 0;
      ++blk;
    }
  }
};

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

// Writes a finished tile: normalised rows into out, or the unnormalised (m, l, acc) of a context slice.
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
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    const float* a = acc + i * p.d;
    if (p.q_bf16) {
      uint16_t* o = static_cast<uint16_t*>(p.out) + off;
      int64_t e = 0;
#if defined(__AVX512BF16__)
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

// ---------------------------------------------------------------------------------------------------------------
// Portable path: plain loops, one row at a time over chunks of keys.
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
      const int64_t off = cur.slot() * p.kv_tok_stride + it.h * d;
      if (p.kv_bf16) {
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

#if PA_AVX512
// ---------------------------------------------------------------------------------------------------------------
// AVX-512 helpers.

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

// out[j] = horizontal sum of v[j], j = 0..15.
inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
    u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int k = 0; k < 2; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// Row pointers (fp32) of the next chunk of keys; bf16 rows are widened into kb/vb. Missing keys (past k1) point
// at the first row so that fixed 16-wide loops stay in bounds (their scores are masked).
template <int ND>
inline void chunk_rows(const Problem& p, int64_t h, KeyCursor& cur, int64_t nk, bool pack, float* kb, float* vb,
                       const float** kr, const float** vr) {
  constexpr int D = ND * 16;
  for (int64_t j = 0; j < nk; ++j, cur.next()) {
    const int64_t off = cur.slot() * p.kv_tok_stride + h * D;
    if (p.kv_bf16) {
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
}

// Software prefetch of the K/V rows ahead of the chunk being computed: the block table scatters the rows, so the
// hardware prefetcher cannot follow across blocks.
#ifndef PA_PREFETCH_CHUNKS
#define PA_PREFETCH_CHUNKS 1
#endif
struct Prefetcher {
  KeyCursor cur;
  int64_t next;  // next key to prefetch
  Prefetcher(const int32_t* table, int64_t bs, int64_t k0) : cur(table, bs, k0), next(k0) {}
  template <int ND>
  inline void run(const Problem& p, int64_t h, int64_t c, int64_t k1) {
    constexpr int D = ND * 16;
    const int64_t esz = p.kv_bf16 ? 2 : 4;
    const int64_t target = std::min<int64_t>(k1, c + (1 + PA_PREFETCH_CHUNKS) * kChunk);
    const char* kbase = static_cast<const char*>(p.kc);
    const char* vbase = static_cast<const char*>(p.vc);
    for (; next < target; ++next, cur.next()) {
      const int64_t off = (cur.slot() * p.kv_tok_stride + h * D) * esz;
      for (int64_t b = 0; b < D * esz; b += 64) {
        _mm_prefetch(kbase + off + b, _MM_HINT_T0);
        _mm_prefetch(vbase + off + b, _MM_HINT_T0);
      }
    }
  }
};

// acc[g] = acc[g] * alpha[g] + sum_j p[g][j] * V[j] for the G rows of one group: all G x ND accumulators stay in
// registers and each V row is loaded once for the whole group (one row at a time would be a chain of dependent
// FMAs, bound by their latency).
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
  alignas(64) float probs[16 * kChunk];  // this chunk's softmax numerators, one row of kChunk per query row
  alignas(64) float alpha[16];           // per row: rescale of the accumulator for the new running max
  for (int64_t c = it.k0; c < it.k1; c += kChunk) {
    const int64_t nk = std::min<int64_t>(kChunk, it.k1 - c);
    pf.run<ND>(p, it.h, c, it.k1);
    chunk_rows<ND>(p, it.h, cur, nk, false, s.kbuf.get(), s.vbuf.get(), kr, vr);
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
      const __m512 sv = reduce16(sacc);
      const __mmask16 km = static_cast<__mmask16>((1u << nv) - 1u);
      const float mn = std::max(m[i], _mm512_mask_reduce_max_ps(km, sv));
      alpha[i] = std::exp2(m[i] - mn);
      const __m512 pv = _mm512_maskz_mov_ps(km, exp2_ps(_mm512_sub_ps(sv, _mm512_set1_ps(mn))));
      l[i] = l[i] * alpha[i] + _mm512_reduce_add_ps(pv);
      m[i] = mn;
      _mm512_store_ps(probs + i * kChunk, pv);
    }
    for (int64_t i = 0; i < rows; i += kGroup)
      accumulate_rows<ND, kGroup>(std::min<int64_t>(kGroup, rows - i), acc + i * D, alpha + i, probs + i * kChunk,
                                  vr, nv_max);
  }
  finish(p, it, acc, m, l, partials);
}

#if defined(__AVX512BF16__)
// "dot" path for bf16 queries over a bf16 cache (decode and short prefills of bf16 models): the raw bf16 rows
// go straight into vdpbf16ps, nothing is widened. Scores: q . k with fp32 sums of exact bf16 products, scaled
// afterwards. Values: the probabilities of a pair of keys as bf16 pairs (high and low parts) and the two V rows
// interleaved, so one vdpbf16ps per part adds both keys into 16 fp32 accumulators. The interleave permutes dims
// within each 32-dim block (pair_dim); unpermute_rows undoes it.
constexpr int kPairChunk = 32;  // keys per online-softmax step

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
// they arrive (on decode steps of the offline workload: ~10.4 ns per key and KV head with one burst per head and
// chunk, ~8.4 spread over the rows).
// NTA: the lines are read once, they should not evict the chunk being computed from L1.
inline void prefetch_line(const uint16_t* a) { _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_NTA); }

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
// samples; with the low part the paths differ about as little as fp32 ones.
inline void split_bf16_pairs(__m512 p0, __m512 p1, __m512i& hi, __m512i& lo) {
  const __m256bh h0 = _mm512_cvtneps_pbh(p0), h1 = _mm512_cvtneps_pbh(p1);
  const __m512 r0 = _mm512_sub_ps(p0, pagedllm::widen_bf16((__m256i)h0));
  const __m512 r1 = _mm512_sub_ps(p1, pagedllm::widen_bf16((__m256i)h1));
  hi = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)h0), (__m256i)h1, 1);
  lo = (__m512i)_mm512_cvtne2ps_pbh(r1, r0);
}

// acc[g] = acc[g] * alpha[g] + sum_j p[g][j] V[j] for G rows, keys taken in pairs (pp: per row, kPairChunk / 2
// bf16 pairs as 32-bit words, high parts then low parts); acc in the interleaved dim order.
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

// Dim held at position q of an accumulator row whose V pairs were interleaved by unpacklo/hi_epi16 per 32-dim
// block: the low half of the block has dims 8k..8k+3 in 128-bit lane k, the high half 8k+4..8k+7.
constexpr int pair_dim(int q) { return q / 32 * 32 + (q % 16) / 4 * 8 + (q % 32) / 16 * 4 + q % 4; }

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
  for (int64_t c = it.k0; c < it.k1; c += kPairChunk) {
    const int64_t nk = std::min<int64_t>(kPairChunk, it.k1 - c);
    const bool has_next = c + kPairChunk < it.k1;
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
#endif

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
// ([D][rows]), K/V elements are broadcast from a packed chunk.
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
    pf.run<ND>(p, it.h, c, it.k1);
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

#if defined(__AVX512BF16__)
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
#endif

template <int ND>
void attend_fast(const Problem& p, const Item& it, Scratch& s, float* partials) {
  const bool lanes = (it.t1 - it.t0) * p.group >= 16;
#if defined(__AVX512BF16__)
  if (p.q_bf16 && p.kv_bf16) {
    if (lanes)
      attend_lanes_bf16<ND>(p, it, s, partials);
    else
      attend_dot_bf16<ND>(p, it, s, partials);
    return;
  }
#endif
  if (lanes)
    attend_lanes<ND>(p, it, s, partials);
  else
    attend_dot<ND>(p, it, s, partials);
}
#endif  // PA_AVX512

using AttendFn = void (*)(const Problem&, const Item&, Scratch&, float*);

AttendFn pick(int64_t d, int64_t impl) {
#if PA_AVX512
  if (impl != 1) {
    if (d == 32) return attend_fast<2>;
    if (d == 64) return attend_fast<4>;
    if (d == 128) return attend_fast<8>;
  }
#endif
  (void)d;
  (void)impl;
  return attend_portable;
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

// The bf16 dot path takes all KV heads of a tile in one item when their rows fit: each key's K and V rows are
// then read whole (hkv * D contiguous elements), a block of keys as one stream.
bool one_item_per_token_row(const Problem& p, int64_t impl, int64_t tokens) {
#if PA_AVX512 && defined(__AVX512BF16__)
  return impl != 1 && p.q_bf16 && p.kv_bf16 && (p.d == 32 || p.d == 64 || p.d == 128) &&
         tokens * p.group < 16 && tokens * p.hq <= kMaxRows;
#else
  (void)p, (void)impl, (void)tokens;
  return false;
#endif
}

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::ScalarType::BFloat16; }
bool is_f32(const at::Tensor& t) { return t.scalar_type() == at::ScalarType::Float; }

// out [T, Hq, D] (contiguous, q's dtype) <- attention of q [T, Hq, D] over the paged context.
// impl: 0 = best available, 1 = portable. min_items: split long contexts until there are this many work items
// (0 = 4 x threads).
}  // namespace

namespace pagedllm {

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor seq_lens, at::Tensor query_start_loc, double scale, int64_t impl,
                     int64_t min_items) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(is_f32(q) || is_bf16(q), "q must be float32 or bfloat16");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.is_contiguous() && out.sizes() == q.sizes(),
              "out must be a contiguous tensor like q");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && (is_f32(k_cache) || is_bf16(k_cache)),
              "k/v cache must both be float32 or bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "k/v cache must be contiguous and of the same shape");
  TORCH_CHECK(q.stride(2) == 1, "q's last dim must be contiguous");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->scalar_type() == at::ScalarType::Int && t->is_contiguous(), "metadata must be contiguous int32");
  const int64_t num_reqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1 && block_tables.dim() == 2 &&
                  block_tables.size(0) == num_reqs,
              "metadata sizes disagree");
  Problem p;
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.kc = k_cache.data_ptr();
  p.vc = v_cache.data_ptr();
  p.bt = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.qsl = query_start_loc.data_ptr<int32_t>();
  p.hq = q.size(1);
  p.hkv = k_cache.size(2);
  p.d = q.size(2);
  p.bs = k_cache.size(1);
  p.maxb = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == p.d && p.hq % p.hkv == 0, "head dims / head counts disagree");
  p.group = p.hq / p.hkv;
  TORCH_CHECK(p.group <= kMaxRows, "query heads per KV head must be <= 64");
  p.q_tok_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.kv_tok_stride = p.hkv * p.d;
  p.qscale = static_cast<float>(scale) * kLog2e;
  p.q_bf16 = is_bf16(q);
  p.kv_bf16 = is_bf16(k_cache);
  const int64_t num_slots = k_cache.size(0) * p.bs;

  // Tiles: up to kMaxRows rows (tokens x group heads) each.
  const int64_t tile_tokens = std::max<int64_t>(1, kMaxRows / p.group);
  std::vector<Item> items;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int32_t n = p.qsl[r + 1] - p.qsl[r];
    const int32_t len = p.seq_lens[r];
    TORCH_CHECK(n >= 0 && n <= len, "request ", r, ": query_len must be in [0, seq_len]");
    TORCH_CHECK((len + p.bs - 1) / p.bs <= p.maxb, "request ", r, ": block table too short");
    for (int64_t b = 0; b < (len + p.bs - 1) / p.bs; ++b) {
      const int64_t blk = p.bt[r * p.maxb + b];
      TORCH_CHECK(blk >= 0 && blk * p.bs < num_slots, "request ", r, ": block id out of range");
    }
    for (int32_t t0 = 0; t0 < n; t0 += static_cast<int32_t>(tile_tokens)) {
      const int32_t t1 = std::min<int32_t>(n, t0 + static_cast<int32_t>(tile_tokens));
      if (one_item_per_token_row(p, impl, t1 - t0)) {
        items.push_back({static_cast<int32_t>(r), 0, t0, t1, 0, len - n + t1, -1, static_cast<int32_t>(p.hkv)});
        continue;
      }
      for (int32_t h = 0; h < p.hkv; ++h)
        items.push_back({static_cast<int32_t>(r), h, t0, t1, 0, len - n + t1, -1});
    }
  }
  if (items.empty()) return;

  // Small batches run on the calling thread: waking a second thread costs microseconds on a quiet machine and
  // milliseconds on a busy one. Work is counted in (key x query row) pairs, ~5-10 ns each.
  int64_t total = 0;
  for (const Item& it : items) total += static_cast<int64_t>(it.k1 - it.k0) * item_rows(p, it);
  const int64_t threads = std::clamp<int64_t>(total / kMinWorkPerThread, 1, std::max(1, at::get_num_threads()));
  // Split long contexts when there are too few items to keep every thread busy (flash-decoding).
  const int64_t want = min_items > 0 ? min_items : (threads > 1 ? 4 * threads : 1);
  int64_t partial_floats = 0;
  std::vector<Item> work;
  std::vector<std::pair<int64_t, int64_t>> groups;  // [begin, end) in work of items that need a merge
  const int64_t base = static_cast<int64_t>(items.size());
  for (const Item& it : items) {
    const int64_t keys = it.k1 - it.k0;
    int64_t ns = 1;
    if (base < want && keys >= 512) ns = std::min<int64_t>((want + base - 1) / base, keys / 256);
    if (ns <= 1) {
      work.push_back(it);
      continue;
    }
    const int64_t span = ((keys + ns - 1) / ns + kChunk - 1) / kChunk * kChunk;
    const int64_t begin = static_cast<int64_t>(work.size());
    const int64_t rows = item_rows(p, it);
    for (int64_t k0 = it.k0; k0 < it.k1; k0 += span) {
      Item sl = it;
      sl.k0 = static_cast<int32_t>(k0);
      sl.k1 = static_cast<int32_t>(std::min<int64_t>(it.k1, k0 + span));
      sl.part = partial_floats;
      partial_floats += rows * (p.d + 2);
      work.push_back(sl);
    }
    groups.emplace_back(begin, static_cast<int64_t>(work.size()));
  }
  // Largest items first so that dynamic scheduling balances causal tiles of very different cost.
  std::vector<int64_t> order(work.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const Item &x = work[a], &y = work[b];
    return (x.k1 - x.k0) * item_rows(p, x) > (y.k1 - y.k0) * item_rows(p, y);
  });
  std::vector<float> partials(partial_floats);
  const AttendFn fn = pick(p.d, impl);
  const int64_t nwork = static_cast<int64_t>(work.size());
  // torch's own OpenMP team (at::parallel_for, no num_threads clause: a second team would spin against torch's
  // on a busy machine), one task per thread pulling items from a shared counter (dynamic balance).
  const int64_t nthr = std::min<int64_t>(threads, nwork);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nthr, 1, [&](int64_t, int64_t) {
    Scratch scratch(p.d);
    // each thread claims its next item before working on the current one, so that the current one's last
    // chunk can prefetch the next one's first keys
    for (int64_t w = next.fetch_add(1, std::memory_order_relaxed); w < nwork;) {
      const int64_t w2 = next.fetch_add(1, std::memory_order_relaxed);
      scratch.next = w2 < nwork ? &work[order[w2]] : nullptr;
      fn(p, work[order[w]], scratch, partials.data());
      w = w2;
    }
  });
  if (!groups.empty()) {
    at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t g = b; g < e; ++g)
        merge(p, work.data() + groups[g].first, groups[g].second - groups[g].first, partials.data());
    });
  }
}

}  // namespace pagedllm

namespace {

// Bit 0: AVX-512 paths compiled in.
int64_t capabilities() { return PA_AVX512 ? 1 : 0; }

}  // namespace

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("paged_attention", &pagedllm::paged_attention);
  m.def("capabilities", &capabilities);
}
