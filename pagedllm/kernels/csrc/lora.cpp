// Batched LoRA (Punica's SGMV, for a CPU): out[i] += B[s] (A[s] x[i]) for every row i whose adapter sits in slot
// s = row_slot[i] (-1: the base model, nothing added), for all rows in one call, whatever mix of adapters they have.
//
// Layout (lora/layers.py fills it): a [S, C, K] and bt [S, C, N] fp32 (B transposed: rank c's output column
// weights are one contiguous row), lo/hi int32 [S, C]: the output columns rank c of slot s writes (its shard's;
// hi <= lo: an unused rank, skipped). A row is computed by itself, the same way whatever else is in the call:
// u[c] = A[s][c] . x[i] as 16 lane sums in increasing k then one fixed tree (the invariant GEMM's scheme), then
// delta[n] = sum over c, in increasing c, of u[c] * bt[s][c][n], then out[i][n] += delta[n] rounded once to out's
// dtype. So a request's tokens do not depend on its batch, nor on the slot its adapter sits in. Up to kRun rows
// of one slot go together (a prompt's rows, a decode step's rows of one adapter): the same arithmetic per row, each
// weight row read once for all of them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

constexpr int kLanes = 16;

float dot16(const float* a, const float* x, int64_t K) {
  float acc[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[k + l] * x[k + l];
  for (int l = 0; k + l < K; ++l) acc[l] += a[k + l] * x[k + l];
  for (int half = kLanes / 2; half > 0; half /= 2)
    for (int l = 0; l < half; ++l) acc[l] += acc[l + half];
  return acc[0];
}

template <typename T>
float load(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>)
    return p[i];
  else
    return pagedllm::bf16_to_f32(p[i]);
}

template <typename T>
void store(T* p, int64_t i, float v) {
  if constexpr (std::is_same_v<T, float>)
    p[i] = v;
  else
    p[i] = pagedllm::f32_to_bf16(v);
}

constexpr int64_t kRun = 8;  // rows of one slot computed together: each A and B row read once for them

template <typename T>
void lora_rows(T* out, const T* x, const float* a, const float* bt, const int32_t* lo, const int32_t* hi,
               const int64_t* row_slot, int64_t rows, int64_t S, int64_t C, int64_t K, int64_t N) {
  for (int64_t i = 0; i < rows; ++i) TORCH_CHECK(row_slot[i] < S, "lora_apply: row ", i, " names a slot of ", S);
  pagedllm::parallel_balanced(rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> xf(kRun * K), u(kRun * C), delta(kRun * N);
    std::vector<int64_t> order;  // the chunk's adapter rows by slot (a decode step interleaves adapters)
    for (int64_t i = r0; i < r1; ++i)
      if (row_slot[i] >= 0) order.push_back(i);
    std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) { return row_slot[p] < row_slot[q]; });
    for (size_t next = 0; next < order.size();) {
      const int64_t s = row_slot[order[next]];
      int64_t run = 1;
      while (run < kRun && next + run < order.size() && row_slot[order[next + run]] == s) ++run;
      const int64_t* idx = order.data() + next;
      for (int64_t r = 0; r < run; ++r)
        for (int64_t k = 0; k < K; ++k) xf[r * K + k] = load(x + idx[r] * K, k);
      int64_t first = N, last = 0;
      for (int64_t c = 0; c < C; ++c) {
        const int64_t l = lo[s * C + c], h = hi[s * C + c];
        if (h <= l) continue;
        for (int64_t r = 0; r < run; ++r) u[r * C + c] = dot16(a + (s * C + c) * K, xf.data() + r * K, K);
        first = std::min(first, l), last = std::max(last, h);
      }
      if (first < last) {
        for (int64_t r = 0; r < run; ++r) std::fill(delta.begin() + r * N + first, delta.begin() + r * N + last, 0.f);
        for (int64_t c = 0; c < C; ++c) {
          const int64_t l = lo[s * C + c], h = hi[s * C + c];
          if (h <= l) continue;
          const float* b = bt + (s * C + c) * N;
          for (int64_t r = 0; r < run; ++r) {
            const float uc = u[r * C + c];
            float* d = delta.data() + r * N;
            for (int64_t n = l; n < h; ++n) d[n] += uc * b[n];
          }
        }
        for (int64_t r = 0; r < run; ++r) {
          T* o = out + idx[r] * N;
          const float* d = delta.data() + r * N;
          for (int64_t n = first; n < last; ++n) store(o, n, load(o, n) + d[n]);
        }
      }
      next += run;
    }
  });
}

void lora_apply(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& lo,
                const at::Tensor& hi, const at::Tensor& row_slot) {
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && out.scalar_type() == dt,
              "lora_apply: x and out must both be float32 or both bfloat16");
  TORCH_CHECK(a.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat, "lora_apply: a and bt are float32");
  TORCH_CHECK(lo.scalar_type() == at::kInt && hi.scalar_type() == at::kInt && row_slot.scalar_type() == at::kLong,
              "lora_apply: lo/hi int32, row_slot int64");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 3 && bt.dim() == 3, "lora_apply: shapes");
  const int64_t rows = x.size(0), K = x.size(1), N = out.size(1), S = a.size(0), C = a.size(1);
  TORCH_CHECK(out.size(0) == rows && a.size(2) == K && bt.size(0) == S && bt.size(1) == C && bt.size(2) == N &&
                  lo.numel() == S * C && hi.numel() == S * C && row_slot.numel() == rows,
              "lora_apply: x [T, K], out [T, N], a [S, C, K], bt [S, C, N], lo/hi [S, C], row_slot [T]");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && a.is_contiguous() && bt.is_contiguous() &&
                  lo.is_contiguous() && hi.is_contiguous() && row_slot.is_contiguous(),
              "lora_apply: contiguous tensors only");
  const int32_t *l = lo.data_ptr<int32_t>(), *h = hi.data_ptr<int32_t>();
  for (int64_t i = 0; i < S * C; ++i)
    TORCH_CHECK(h[i] <= l[i] || (l[i] >= 0 && h[i] <= N), "lora_apply: a column range outside [0, N)");
  if (dt == at::kFloat)
    lora_rows(out.data_ptr<float>(), x.data_ptr<float>(), a.data_ptr<float>(), bt.data_ptr<float>(), l, h,
              row_slot.data_ptr<int64_t>(), rows, S, C, K, N);
  else
    lora_rows(reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(x.data_ptr()),
              a.data_ptr<float>(), bt.data_ptr<float>(), l, h, row_slot.data_ptr<int64_t>(), rows, S, C, K, N);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) { m.def("lora_apply", &lora_apply); }
