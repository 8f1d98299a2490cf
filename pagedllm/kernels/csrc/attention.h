// Paged attention on the CPU: what the planner (paged_attention.cpp) and the six paths (attention_*.cpp) share.
//
// One work item = (request, KV head, tile of new tokens, slice of the context). All query heads of the KV head's
// group are handled together, so each K/V row is read once per tile for the whole group (GQA-aware). Softmax is
// online over chunks of keys; slices of a long context are merged at the end (flash-decoding style).
//
// int8 KV (kv_int8): with AVX512-VNNI every tile takes the "int8 dot" path (attention_dot_int8.cpp: q rounded to
// int8 per 32 values, q . k on vpdpbusd over the rows as stored, p . V on vpdpwssd with the probabilities rounded
// to 15 bits, an item per request with all its KV heads).
// Elsewhere each row is dequantized (value x its row's scale, exact in fp32) as it is loaded, into the same fp32
// chunk buffers the bf16 rows are widened into, and the fp32 dot and lanes paths and the portable path run on them
// unchanged (the bf16 paths need a bf16 cache and never see int8).
//
// Three inner loops, all with fp32 accumulators:
//   * "dot" path (few query rows, e.g. decode): 16 dot products per row, reduced into one vector of 16 scores;
//     bf16 K/V are widened when loaded;
//   * "bf16 dot" path (the same rows when q and the cache are both bf16 and the CPU has AVX512-BF16): the bf16
//     rows go straight into vdpbf16ps, and an item takes all KV heads of the request (whole K/V token rows, read
//     as one stream per block; see one_item_per_token_row; one head per item where a step has too few slices of
//     work for the threads, e.g. a lone decode token), with prefetches spread over the chunk's work;
//   * "lanes" path (>= kLanesMinRows query rows, prefill): query rows live in vector lanes, K/V elements are broadcast, so
//     the row max / rescale of the online softmax are plain vertical vector ops; with bf16 q and cache on an
//     AVX512-BF16 CPU, pairs of bf16 elements are broadcast into vdpbf16ps instead (attend_lanes_bf16).
// The bf16 paths multiply V by the softmax probabilities split into a high and a low bf16 part (split_bf16_pairs);
// sums stay fp32.
// They need AVX-512 (compiled with -mavx512* when the CPU has it, see kernels/build.py); the portable path is plain
// C++ and is used when the build lacks AVX-512, for head dims other than 32/64/128/256, or on request. With
// AVX512-BF16 the bf16 outputs are rounded by vcvtne2ps2bf16/vcvtneps2bf16.
//
// Scores are computed in base 2: q is pre-multiplied by scale * log2(e) (the bf16 paths multiply the fp32 sum
// instead) and exp2 replaces exp.
//
// Files: attention_tile.cpp (queries in, results out, the merge of context slices), one file per path
// (attention_portable / _dot / _dot_int8 / _dot_bf16 / _lanes / _lanes_bf16.cpp), attention_avx512.h (their vector helpers),
// paged_attention.cpp (the op: checks, work items, context splits, threads).
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "common.h"


namespace pagedllm::attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kChunk = 16;     // keys per online-softmax step
constexpr int kMaxRows = 64;   // query rows (tokens x group heads) per tile
// A tile with at least this many query rows (tokens x group heads) takes a "lanes" path: its rows fill the 16
// lanes of a vector. Fewer rows take a "dot" path.
constexpr int64_t kLanesMinRows = 16;
// Head dims with vector paths, as a mask of powers of two (the others take the portable path).
constexpr int64_t kVectorHeadDims = 32 | 64 | 128 | 256;
constexpr bool vector_head_dim(int64_t d) { return d > 0 && (d & (d - 1)) == 0 && (d & kVectorHeadDims); }

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
  int64_t kv_head_stride;               // elements of one (token, KV head) row: d, or d + kScaleBytes for int8
  int64_t kv_tok_stride;                // hkv * kv_head_stride
  float qscale;                         // scale * log2(e)
  bool q_bf16, kv_bf16;                 // out has q's dtype
  bool kv_int8;                         // int8 rows, each followed by its float16 scale (attention/kv_quant.py)
  bool invariant;                       // batch-invariant mode (see paged_attention.cpp)
  const float* sinks = nullptr;         // [hq] sink logits in base 2 (x log2 e), or none
};

// What a head's sink adds to a row's softmax denominator, relative to the row's running max m (base 2): the
// sink weighs like a key of score `sink` whose value is zero, so it is added once, when the row is finished.
inline float sink_weight(const Problem& p, int64_t head, float m) {
  return p.sinks ? std::exp2(p.sinks[head] - m) : 0.f;
}

// An int8 KV row: d int8 values, then the two bytes of its float16 scale (value = q * scale).
constexpr int64_t kScaleBytes = 2;

inline float int8_row_scale(const int8_t* row, int64_t d) {
  uint16_t h;
  std::memcpy(&h, row + d, sizeof h);
  return pagedllm::f16_to_f32(h);
}

struct Item {
  int32_t r, h, t0, t1;  // request, first KV head, new tokens [t0, t1) of the request
  int32_t k0, k1;        // keys [k0, k1) of the context
  int64_t part;          // offset of this slice's partial result in the partials buffer, -1 = write out directly
  int32_t nh = 1;        // KV heads h .. h + nh - 1 (more than one on the bf16 decode path only)
  int32_t q0 = 0, nq = 0;  // query heads q0 .. q0 + nq - 1 of each KV head's group (nq = 0: the whole group)
};

// Query heads per KV head in an item.
inline int64_t item_group(const Problem& p, const Item& it) { return it.nq > 0 ? it.nq : p.group; }

// Query rows of an item, head-major: with g = item_group, row i = KV head h + i / per_head, token
// t0 + (i % per_head) / g, query head (h + i / per_head) * group + q0 + i % g.
inline int64_t item_rows(const Problem& p, const Item& it) {
  return static_cast<int64_t>(it.t1 - it.t0) * item_group(p, it) * it.nh;
}

// (token, query head) of row i.
inline std::pair<int64_t, int64_t> row_of(const Problem& p, const Item& it, int64_t i) {
  const int64_t g = item_group(p, it), per_head = static_cast<int64_t>(it.t1 - it.t0) * g;
  const int64_t hh = i / per_head, rem = i % per_head;
  return {it.t0 + rem / g, (it.h + hh) * p.group + it.q0 + rem % g};
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


inline bool uses_lanes(const Problem& p, int64_t tokens) { return tokens * p.group >= kLanesMinRows; }

// attention_tile.cpp
void load_queries(const Problem& p, const Item& it, float* qbuf, int32_t* pos);
void start_tile(const Problem& p, const Item& it, Scratch& s, int64_t rows);
void finish(const Problem& p, const Item& it, const float* acc, const float* m, const float* l, float* partials);
void merge(const Problem& p, const Item* slices, int64_t nslices, const float* partials);

// The paths: each computes one work item (a tile of query rows over a slice of the context).
using AttendFn = void (*)(const Problem&, const Item&, Scratch&, float*);
void attend_portable(const Problem& p, const Item& it, Scratch& s, float* partials);
// ND = head dim / 16, instantiated for head dims 32, 64, 128 and 256 (Gemma 3).
template <int ND> void attend_dot(const Problem& p, const Item& it, Scratch& s, float* partials);
constexpr int64_t kDotInt8MaxHeads = 8;  // KV heads one item of the int8 dot path may take (paged_attention.cpp)
template <int ND> void attend_dot_int8(const Problem& p, const Item& it, Scratch& s, float* partials);
template <int ND> void attend_dot_bf16(const Problem& p, const Item& it, Scratch& s, float* partials);
template <int ND> void attend_lanes(const Problem& p, const Item& it, Scratch& s, float* partials);
template <int ND> void attend_lanes_bf16(const Problem& p, const Item& it, Scratch& s, float* partials);

#define PA_INSTANTIATE(path)                                                    \
  template void path<2>(const Problem&, const Item&, Scratch&, float*);        \
  template void path<4>(const Problem&, const Item&, Scratch&, float*);        \
  template void path<8>(const Problem&, const Item&, Scratch&, float*);        \
  template void path<16>(const Problem&, const Item&, Scratch&, float*);

}  // namespace pagedllm::attn
