// Sampling one token per row from logits with temperature, min-p, top-k and top-p, without sorting the vocabulary.
//
// A row's probabilities exp((logit - max) / T) go to a per-thread buffer (unnormalised: every step below works on
// unnormalised mass). Each filter keeps the tokens whose probability is at least some cutoff, so a row's kept set is
// {p >= floor}: min-p's cutoff is min_p * max(p); top-k's is the k-th largest probability; top-p's (vLLM's rule:
// keep a token while the mass of the tokens before it in descending order is below top_p, over what min-p and
// top-k kept) is the probability at which that running mass first reaches top_p. The k-th largest value and the
// mass crossing are found by a radix select on the float bits (non-negative floats order like their bits):
// a 2048-bin histogram over the row picks the bin holding the crossing, then two finer histograms over that bin's
// members pin the exact value (for top-p only over the tokens above (1 - top_p) * mass / V, the only ones that can
// be in the nucleus). A token is then drawn by inverse CDF in vocabulary order over the kept set.
// Cost per row: a handful of linear passes over the row (it stays in L2), independent of how wide the nucleus is.

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"  // (and immintrin.h where AVX-512 is on)

namespace {

inline uint32_t key_of(float p) {
  uint32_t k;
  std::memcpy(&k, &p, sizeof k);
  return k;
}

inline float value_of(uint32_t k) {
  float p;
  std::memcpy(&p, &k, sizeof p);
  return p;
}

// Walks bins from the highest down; returns the bin where acc + bin total first reaches target (adding the
// totals of the bins above it to acc), or the lowest non-empty bin when rounding keeps the total short of target.
int crossing_bin(const double* hist, int bins, double target, double& acc) {
  int lowest = -1;
  double acc_lowest = acc;
  for (int b = bins - 1; b >= 0; --b) {
    if (hist[b] == 0.0) continue;
    if (acc + hist[b] >= target) return b;
    lowest = b;
    acc_lowest = acc;
    acc += hist[b];
  }
  acc = acc_lowest;
  return lowest;
}

// Key of the element at which the running total (of counts, or of probabilities when by_mass) taken in
// descending order over the elements with key >= floor first reaches target; floor if there are none.
// The passes are branch-free: which bin an element falls in is data, not a predictable branch.
uint32_t cutoff_key(const float* p, int64_t n, uint32_t floor, double target, bool by_mass) {
  // The candidates (key >= floor) first, compressed into members: with a high floor (top-p, see sample_row) they
  // are a small part of the row and the histograms below touch only them.
  thread_local std::vector<uint32_t> members;
  members.resize(n);
  int64_t m = 0, i = 0;
#if PL_AVX512
  const __m512i vfloor = _mm512_set1_epi32(static_cast<int32_t>(floor));
  for (; i + 16 <= n; i += 16) {
    const __m512i k = _mm512_loadu_si512(p + i);
    const __mmask16 keep = _mm512_cmp_epu32_mask(k, vfloor, _MM_CMPINT_NLT);
    _mm512_mask_compressstoreu_epi32(members.data() + m, keep, k);
    m += __builtin_popcount(keep);
  }
#endif
  for (; i < n; ++i) {
    const uint32_t k = key_of(p[i]);
    members[m] = k;
    m += k >= floor;
  }
  constexpr int kLanes = 4;  // interleaved histograms break the store-to-load chain on runs of equal bins
  // all zero between calls: only the bins the members touch are summed and reset (zeroing and summing all 8192
  // lanes for every row cost more than the histogram itself once top-p leaves few members)
  thread_local std::array<double, 2048 * kLanes> lanes{};
  uint32_t lo = 2047, hi = 0;
  for (int64_t j = 0; j < m; ++j) {
    const uint32_t b = members[j] >> 20;
    lanes[b * kLanes + (j & (kLanes - 1))] += by_mass ? value_of(members[j]) : 1.0;
    lo = std::min(lo, b);
    hi = std::max(hi, b);
  }
  std::array<double, 2048> hist;
  hist.fill(0.0);
  for (uint32_t b = lo; m > 0 && b <= hi; ++b)
    for (int l = 0; l < kLanes; ++l) {
      hist[b] += lanes[b * kLanes + l];
      lanes[b * kLanes + l] = 0.0;
    }
  double acc = 0.0;
  const int top = crossing_bin(hist.data(), m > 0 ? static_cast<int>(hi) + 1 : 0, target, acc);
  if (top < 0) return floor;
  int64_t kept = 0;
  for (int64_t j = 0; j < m; ++j) {
    members[kept] = members[j];
    kept += (members[j] >> 20) == static_cast<uint32_t>(top);
  }
  m = kept;
  // Bits 19..9, then 8..0, of the members: after both levels every remaining member has the same key.
  for (const auto [shift, bins] : {std::pair<int, int>{9, 2048}, std::pair<int, int>{0, 512}}) {
    hist.fill(0.0);
    for (int64_t j = 0; j < m; ++j) hist[(members[j] >> shift) & (bins - 1)] += by_mass ? value_of(members[j]) : 1.0;
    const uint32_t bin = static_cast<uint32_t>(crossing_bin(hist.data(), bins, target, acc));
    kept = 0;
    for (int64_t j = 0; j < m; ++j) {
      members[kept] = members[j];
      kept += ((members[j] >> shift) & (bins - 1)) == bin;
    }
    m = kept;
  }
  return members[0];
}

// Sum of the probabilities with key >= floor, as a masked vector reduction: a branch per element
// mispredicts whenever kept and dropped tokens interleave, which is the usual case.
double kept_mass(const float* p, int64_t n, uint32_t floor) {
  const float lowest = value_of(floor);
  int64_t i = 0;
  double s = 0.0;
#if PL_AVX512
  const __m512 lo = _mm512_set1_ps(lowest);
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_loadu_ps(p + i), lo, _CMP_GE_OQ),
                                         _mm512_loadu_ps(p + i));
    a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
  }
  s = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#endif
  double lanes[8] = {};
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += p[i + l] >= lowest ? static_cast<double>(p[i + l]) : 0.0;
  for (; i < n; ++i) s += p[i] >= lowest ? static_cast<double>(p[i]) : 0.0;
  for (double v : lanes) s += v;
  return s;
}

// Inverse CDF in vocabulary order over the kept tokens: block sums find the block, a scan finds the token.
int64_t draw(const float* p, int64_t n, uint32_t floor, double target) {
  constexpr int64_t kBlock = 512;
  double acc = 0.0;
  int64_t last = -1;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(kBlock, n - start);
    const double block = kept_mass(p + start, len, floor);
    if (block == 0.0) continue;
    if (acc + block > target) {
      for (int64_t i = start; i < start + len; ++i) {
        if (key_of(p[i]) < floor || p[i] == 0.0f) continue;
        acc += p[i];
        last = i;
        if (acc > target) return i;
      }
      return last;  // rounding: the block's sum and the scan disagree in the last bits
    }
    acc += block;
    for (int64_t i = start + len - 1; i >= start; --i)
      if (key_of(p[i]) >= floor && p[i] != 0.0f) { last = i; break; }
  }
  return last < 0 ? 0 : last;  // target at the very top of the CDF (rounding)
}

// p[i] = exp((logits[i] - max) / temperature)
void probabilities(const float* logits, int64_t n, float temperature, float* p) {
  float mx = logits[0];
  int64_t i = 0;
#if PL_AVX512  // (the compiler keeps a plain max loop scalar: std::max's NaN order)
  __m512 vmax = _mm512_set1_ps(mx);
  for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(logits + i));
  mx = _mm512_reduce_max_ps(vmax);
#endif
  for (; i < n; ++i) mx = std::max(mx, logits[i]);
  const float inv_t = 1.0f / temperature;
  i = 0;
#if PL_AVX512
  const __m512 vmx = _mm512_set1_ps(mx), vinv = _mm512_set1_ps(inv_t);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(p + i, pagedllm::exp_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(logits + i), vmx), vinv)));
#endif
  for (; i < n; ++i) p[i] = std::exp((logits[i] - mx) * inv_t);
}

int64_t sample_row(const float* logits, int64_t n, float temperature, int64_t top_k, float top_p, float min_p,
                   double uniform) {
  thread_local std::vector<float> buffer;
  buffer.resize(n);
  float* p = buffer.data();
  probabilities(logits, n, temperature, p);
  uint32_t floor = 0;
  if (min_p > 0.0f) floor = key_of(min_p);  // the most likely token has p = 1 here
  if (top_k > 0 && top_k < n) floor = std::max(floor, cutoff_key(p, n, floor, static_cast<double>(top_k), false));
  if (top_p < 1.0f) {
    // Tokens below (1 - top_p) * mass / n are never in the nucleus (together they hold at most (1 - top_p) of the
    // mass, so the crossing lies above them): only the tokens above that enter the histograms.
    const double mass = kept_mass(p, n, floor);
    const uint32_t candidates = std::max(floor, key_of(static_cast<float>((1.0 - top_p) * mass / n)));
    floor = std::max(floor, cutoff_key(p, n, candidates, top_p * mass, true));
  }
  return draw(p, n, floor, uniform * kept_mass(p, n, floor));
}

// logits [N, V] float32, temperature / top_p / min_p float32 [N], top_k int64 [N] (0 = off),
// uniforms float64 [N] in [0, 1) -> token ids int64 [N].
torch::Tensor sample_from_logits(const torch::Tensor& logits, const torch::Tensor& temperature,
                                 const torch::Tensor& top_k, const torch::Tensor& top_p, const torch::Tensor& min_p,
                                 const torch::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "logits must be a contiguous float32 [N, V] tensor");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "empty vocabulary");
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat32 && top_k.scalar_type() == torch::kInt64 &&
                  top_p.scalar_type() == torch::kFloat32 && min_p.scalar_type() == torch::kFloat32 &&
                  uniforms.scalar_type() == torch::kFloat64,
              "temperature / top_p / min_p float32, top_k int64, uniforms float64");
  for (const auto* t : {&temperature, &top_k, &top_p, &min_p, &uniforms})
    TORCH_CHECK(t->numel() == rows, "one temperature / top_k / top_p / min_p / uniform per row");
  const auto temperature_c = temperature.contiguous(), top_k_c = top_k.contiguous();
  const auto top_p_c = top_p.contiguous(), min_p_c = min_p.contiguous(), uniforms_c = uniforms.contiguous();
  auto out = torch::empty({rows}, torch::kInt64);
  const float* lp = logits.data_ptr<float>();
  const float* tt = temperature_c.data_ptr<float>();
  const int64_t* tk = top_k_c.data_ptr<int64_t>();
  const float* tp = top_p_c.data_ptr<float>();
  const float* mp = min_p_c.data_ptr<float>();
  const double* u = uniforms_c.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
#pragma omp parallel for schedule(dynamic, 1) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) o[r] = sample_row(lp + r * n, n, tt[r], tk[r], tp[r], mp[r], u[r]);
  return out;
}

// The first index of each row's maximum (torch.argmax for rows without NaN), rows in parallel: torch's
// argmax was a visible part of large greedy decode steps (`pagedllm bench throughput`).
int64_t argmax_row(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t index = 0, i = 0;
#if PL_AVX512
  if (n >= 16) {
    __m512 vmax = _mm512_set1_ps(best);
    __m512i vidx = _mm512_setzero_si512();
    __m512i cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; i + 16 <= n; i += 16, cur = _mm512_add_epi32(cur, step)) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);  // strictly greater: a lane keeps its first
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    }
    alignas(64) float vals[16];
    alignas(64) int32_t idxs[16];
    _mm512_store_ps(vals, vmax);
    _mm512_store_si512(idxs, vidx);
    for (int l = 0; l < 16; ++l)
      if (vals[l] > best || (vals[l] == best && idxs[l] < index)) best = vals[l], index = idxs[l];
  }
#endif
  for (; i < n; ++i)
    if (x[i] > best) best = x[i], index = i;
  return index;
}

torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "logits must be a contiguous float32 [N, V] tensor");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0 && n < (int64_t{1} << 31), "vocabulary size out of range");
  auto out = torch::empty({rows}, torch::kInt64);
  const float* lp = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
#pragma omp parallel for if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) o[r] = argmax_row(lp + r * n, n);
  return out;
}

// Whether every element is finite (the step's check of its logits before sampling): one pass on the calling
// thread over the exponent bits, which the compiler vectorises. torch's sum woke a second thread for one row.
bool all_finite(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), "all_finite: a contiguous float32 tensor");
  const uint32_t* bits = static_cast<const uint32_t*>(t.data_ptr());
  uint32_t special = 0;  // all exponent bits set: an infinity or a NaN
  for (int64_t i = 0, n = t.numel(); i < n; ++i) special |= (bits[i] & 0x7f800000u) == 0x7f800000u;
  return special == 0;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("sample_from_logits", &sample_from_logits);
  m.def("argmax_rows", &argmax_rows);
  m.def("all_finite", &all_finite);
}
