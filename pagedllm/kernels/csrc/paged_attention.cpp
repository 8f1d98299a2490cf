// The paged_attention op: checks its tensors, cuts the batch into work items (tiles of query rows x slices of
// the context), picks a path per item and runs the items on torch's threads. See attention.h for the paths.
//
// Batch-invariant mode (mode.invariant): a query row's output must not depend on the other rows of its tile (how the
// prompt was chunked, whether its prefix came from the cache), on the other requests, or on the thread count.
// Each path computes a row on its own, but the dot and lanes paths sum in different orders, and the context
// split depends on the batch. So in this mode every tile takes a dot path, the bf16 one where q and the cache are
// bf16 on an AVX512-BF16 build and the fp32 one elsewhere (their per-row arithmetic does not depend on the tile's
// other rows: masked keys add exact zeros), and a context is cut into slices at fixed key positions (multiples of
// kInvariantSliceKeys) whatever the batch, merged in slice order.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "attention.h"

namespace pagedllm::attn {
namespace {

constexpr int64_t kMinWorkPerThread = 1 << 9;  // (key x row) pairs: below this a second thread costs more than it saves
// Long contexts are split (flash-decoding) when there are fewer than kItemsPerThread items per thread: more items
// than threads let the dynamic schedule even out items of different lengths.
constexpr int64_t kItemsPerThread = 4;
constexpr int64_t kMinKeysToSplit = 512;   // shorter contexts are never split: the merge would cost more
constexpr int64_t kMinKeysPerSlice = 256;  // no slice shorter than this
constexpr int64_t kInvariantSliceKeys = 512;  // batch-invariant mode: the fixed slice length (a multiple of kChunk)

#if PL_AVX512
template <int ND>
void attend_fast(const Problem& p, const Item& it, Scratch& s, float* partials) {
#if PL_VNNI
  if (p.kv_int8) return attend_dot_int8<ND>(p, it, s, partials);  // every tile, in both modes
#endif
  const bool lanes = !p.invariant && uses_lanes(p, it.t1 - it.t0);  // invariant: every tile on a dot path
#if PL_AVX512_BF16
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
#endif  // PL_AVX512

AttendFn pick(int64_t d, KernelMode mode) {
#if PL_AVX512
  if (!mode.portable) {
    if (d == 32) return attend_fast<2>;
    if (d == 64) return attend_fast<4>;
    if (d == 128) return attend_fast<8>;
    if (d == 256) return attend_fast<16>;
  }
#endif
  (void)d;
  (void)mode;
  return attend_portable;
}

// The bf16 and int8 dot paths take all KV heads of a tile in one item when their rows fit: each key's K and V
// rows are then read whole (hkv rows side by side), a block of keys as one stream.
bool one_item_per_token_row(const Problem& p, KernelMode mode, int64_t tokens) {
  if (mode.portable || !vector_head_dim(p.d) || tokens * p.hq > kMaxRows) return false;
#if PL_VNNI
  if (p.kv_int8) return p.hkv <= kDotInt8MaxHeads;  // every tile takes the int8 dot path, in both modes
#endif
#if PL_AVX512_BF16
  return p.q_bf16 && p.kv_bf16 && (mode.invariant || !uses_lanes(p, tokens));
#else
  return false;
#endif
}

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::ScalarType::BFloat16; }
bool is_f32(const at::Tensor& t) { return t.scalar_type() == at::ScalarType::Float; }

}  // namespace
}  // namespace pagedllm::attn

namespace pagedllm {

using namespace pagedllm::attn;

// out [T, Hq, D] (contiguous, q's dtype) <- attention of q [T, Hq, D] over the paged context.
// portable: the plain C++ path only; invariant: batch-invariant arithmetic (common.h, KernelMode). min_items: split long contexts until there are this many work items
// (0 = kItemsPerThread x threads).
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor seq_lens, at::Tensor query_start_loc, double scale, bool portable,
                     bool invariant, int64_t min_items, int64_t window, const std::optional<at::Tensor>& sinks) {
  const KernelMode mode{portable, invariant};
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(is_f32(q) || is_bf16(q), "q must be float32 or bfloat16");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.is_contiguous() && out.sizes() == q.sizes(),
              "out must be a contiguous tensor like q");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && (is_f32(k_cache) || is_bf16(k_cache) ||
                                                                  k_cache.scalar_type() == at::ScalarType::Char),
              "k/v cache must both be float32, bfloat16 or int8 (rows with their scales)");
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
  p.kv_int8 = k_cache.scalar_type() == at::ScalarType::Char;
  p.kv_head_stride = p.d + (p.kv_int8 ? kScaleBytes : 0);
  TORCH_CHECK(k_cache.size(3) == p.kv_head_stride && p.hq % p.hkv == 0, "head dims / head counts disagree");
  p.group = p.hq / p.hkv;
  TORCH_CHECK(p.group <= kMaxRows, "query heads per KV head must be <= 64");
  p.q_tok_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.kv_tok_stride = p.hkv * p.kv_head_stride;
  p.qscale = static_cast<float>(scale) * kLog2e;
  p.q_bf16 = is_bf16(q);
  p.kv_bf16 = is_bf16(k_cache);
  p.invariant = mode.invariant;
  std::vector<float> sinks2;  // the sinks in base 2, as the scores are
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::ScalarType::Float && sinks->is_contiguous() && sinks->dim() == 1 &&
                    sinks->size(0) == p.hq,
                "sinks must be a contiguous float32 tensor of one logit per query head");
    const float* s = sinks->data_ptr<float>();
    for (int64_t h = 0; h < p.hq; ++h) sinks2.push_back(s[h] * kLog2e);
    p.sinks = sinks2.data();
  }
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
    // A sliding window that binds: one token per tile, so that every row of an item has the same window and the
    // item's key range [k0, k1) is exactly that window (no path needs a per-row lower mask, and keys before it,
    // whose blocks may have been freed, are never read).
    // Otherwise the tokens are cut into equal tiles (17 tokens: 9 + 8, not 16 + 1), and a lone request's few tokens
    // (a verification of drafts) into at least one tile per thread, so that no thread waits for the other.
    const bool slide = window > 0 && len > window;
    const int64_t tiles = slide ? n : std::max<int64_t>((n + tile_tokens - 1) / tile_tokens,
                                                        std::min<int64_t>(n, at::get_num_threads() / num_reqs));
    for (int64_t i = 0; i < tiles; ++i) {
      const int32_t t0 = static_cast<int32_t>(n * i / tiles), t1 = static_cast<int32_t>(n * (i + 1) / tiles);
      const int32_t k0 = slide ? std::max<int32_t>(0, len - n + t0 - static_cast<int32_t>(window) + 1) : 0;
      if (one_item_per_token_row(p, mode, t1 - t0)) {
        items.push_back({static_cast<int32_t>(r), 0, t0, t1, k0, len - n + t1, -1, static_cast<int32_t>(p.hkv)});
        continue;
      }
      for (int32_t h = 0; h < p.hkv; ++h)
        items.push_back({static_cast<int32_t>(r), h, t0, t1, k0, len - n + t1, -1});
    }
  }
  if (items.empty()) return;

  // Small batches run on the calling thread: waking a second thread costs microseconds on a quiet machine and
  // milliseconds on a busy one. Work is counted in (key x query row) pairs. A decode token's attention over a
  // context of a few hundred keys already pays for it: its KV rows come from memory (BENCHMARKS.md, issue 29).
  int64_t total = 0;
  for (const Item& it : items) total += static_cast<int64_t>(it.k1 - it.k0) * item_rows(p, it);
  const int64_t threads = std::clamp<int64_t>(total / kMinWorkPerThread, 1, std::max(1, at::get_num_threads()));
  // Too few slices of work to balance the threads (a lone decode token: one slice per 512 keys): an item of several
  // KV heads becomes one item per head, so that the heads run on different threads; where that still leaves a
  // thread idle (one KV head, as in Gemma 3), each head's query heads are cut in parts. A row's arithmetic is the
  // same either way (its scores, softmax and sums involve no other row), so batch invariance holds.
  const auto slices_of = [&](const Item& it) -> int64_t {  // the invariant mode's fixed slices (else one)
    return p.invariant ? (it.k1 - it.k0 + kInvariantSliceKeys - 1) / kInvariantSliceKeys : 1;
  };
  int64_t slices = 0, head_slices = 0;  // slices, and slices once every item is one KV head
  for (const Item& it : items) slices += slices_of(it), head_slices += slices_of(it) * it.nh;
  if (slices < kItemsPerThread * threads) {
    const int64_t parts = std::clamp<int64_t>((threads + head_slices - 1) / head_slices, 1, p.group);
    std::vector<Item> split;
    for (const Item& it : items)
      for (int32_t h = 0; h < it.nh; ++h)
        for (int64_t q = 0; q < parts; ++q) {
          Item one = it;
          one.h = it.h + h, one.nh = 1;
          one.q0 = static_cast<int32_t>(p.group * q / parts);
          one.nq = static_cast<int32_t>(p.group * (q + 1) / parts) - one.q0;
          split.push_back(one);
        }
    items = std::move(split);
  }
  // Split long contexts when there are too few items to keep every thread busy (flash-decoding).
  const int64_t want = min_items > 0 ? min_items : (threads > 1 ? kItemsPerThread * threads : 1);
  int64_t partial_floats = 0;
  std::vector<Item> work;
  std::vector<std::pair<int64_t, int64_t>> groups;  // [begin, end) in work of items that need a merge
  const int64_t base = static_cast<int64_t>(items.size());
  for (const Item& it : items) {
    const int64_t keys = it.k1 - it.k0;
    int64_t span = keys;
    if (p.invariant) {
      span = kInvariantSliceKeys;  // slices at fixed offsets from it.k0 (0, or the row's window start)
    } else if (base < want && keys >= kMinKeysToSplit) {
      const int64_t ns = std::min<int64_t>((want + base - 1) / base, keys / kMinKeysPerSlice);
      span = ((keys + ns - 1) / ns + kChunk - 1) / kChunk * kChunk;
    }
    if (span >= keys) {
      work.push_back(it);
      continue;
    }
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
  const AttendFn fn = pick(p.d, mode);
  const int64_t nwork = static_cast<int64_t>(work.size());
  // torch's own OpenMP team (at::parallel_for, no num_threads clause: a second team would spin against torch's
  // on a busy machine), one task per thread pulling items from a shared counter (dynamic balance).
  const int64_t nthr = std::min<int64_t>(threads, nwork);
  std::atomic<int64_t> next{nthr};
  at::parallel_for(0, nthr, 1, [&](int64_t t0, int64_t t1) {
    Scratch scratch(p.d);
    // Task t starts with item t (the first items are dealt out, so that two items on two threads never end up
    // on one: a thread claims its next item before working on the current one, so that the current one's last
    // chunk can prefetch the next one's first keys), then pulls from the counter.
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t w = t; w < nwork;) {
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

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("paged_attention", &pagedllm::paged_attention);
}
