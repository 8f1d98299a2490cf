// A mixture-of-experts MLP with GGUF-block experts in one call (model/moe.py holds the Python form of the same
// steps, which runs where this op does not): a decode step's k experts, or a prompt's tokens grouped by expert,
// without a Python call per expert and matrix (on a 2-core CPU those calls cost more than the experts' bytes).
//
// For every expert e chosen by some token (in expert order), its tokens' rows (in token order) go through
//   gu = x W_gate_up[e]^T (+ bias), h = glu(gu[:, :I], gu[:, I:]), y = h W_down[e]^T (+ bias)
// with the quantized GEMM (quant_gemm_raw: each output computed the same way whatever the rows around it), all in
// fp32, and slot j of token t keeps y * weight[t, j]. A token's output is the sum of its k slots in slot order,
// rounded once to x's dtype. So a token's result depends on its row alone: the same alone, in any batch, in any
// prompt chunk.
//
// Experts are given by the data pointers of their stored matrices (gate_up: [2I, H] rows, down: [H, I] rows, one
// ggml type each, packed or not): the module that calls holds the tensors (model/moe.py: ExpertTable).

#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "common.h"
#include "quant_gemm.h"

namespace {

enum Glu : int64_t { kSwiGlu = 0, kClampedSwiGlu = 1 };

// Up to this many rows for the busiest expert, a step's experts run side by side (one per thread at a time);
// beyond, one after another, each GEMM across the threads.
constexpr int64_t kSideBySideRows = 8;

// h[i] from gate g and up u: SwiGLU silu(g) * u; gpt-oss's clamped form (g clamped above at limit, u to
// [-limit, limit], the gate's sigmoid sharpened by alpha, 1 added to u).
inline float glu(int64_t kind, float g, float u, float limit, float alpha) {
  if (kind == kClampedSwiGlu) {
    g = std::min(g, limit);
    u = std::min(std::max(u, -limit), limit);
    return (u + 1.f) * (g / (1.f + std::exp(-g * alpha)));
  }
  return g / (1.f + std::exp(-g)) * u;
}

}  // namespace

namespace pagedllm {

// Router logits of one token (E of them) -> its k experts and their weights, as model/moe.py's route: softmax
// over all experts in fp32, the k most probable (on a tie the lower expert id first), renormalised to sum to 1
// when asked. Row-local: the same for a token in every batch.
void route_row(const float* logits, int64_t E, int64_t k, bool renormalize, int64_t* experts, float* weights) {
  float top = logits[0];
  for (int64_t e = 1; e < E; ++e) top = std::max(top, logits[e]);
  std::vector<float> p(E);
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(logits[e] - top));
  std::vector<int64_t> ids(E);
  for (int64_t e = 0; e < E; ++e) ids[e] = e;
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                    [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  float chosen = 0.f;
  for (int64_t j = 0; j < k; ++j) chosen += (weights[j] = p[ids[j]] / sum), experts[j] = ids[j];
  if (renormalize)
    for (int64_t j = 0; j < k; ++j) weights[j] /= chosen;
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                       const at::Tensor& gate_up_ptrs, const at::Tensor& down_ptrs, int64_t gate_up_qtype,
                       int64_t down_qtype, int64_t intermediate, const std::optional<at::Tensor>& gate_up_bias,
                       const std::optional<at::Tensor>& down_bias, int64_t glu_kind, double limit, double alpha) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_experts: x must be contiguous fp32/bf16 [T, H]");
  const int64_t T = x.size(0), H = x.size(1), I = intermediate, E = gate_up_ptrs.numel();
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.dim() == 2 && experts.size(0) == T &&
                  experts.is_contiguous(), "moe_experts: experts must be int64 [T, k]");
  const int64_t k = experts.size(1);
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == experts.sizes() && weights.is_contiguous(),
              "moe_experts: weights must be fp32 [T, k]");
  TORCH_CHECK(gate_up_ptrs.scalar_type() == at::kLong && down_ptrs.scalar_type() == at::kLong &&
                  down_ptrs.numel() == E, "moe_experts: one gate_up and one down pointer per expert");
  TORCH_CHECK(pagedllm::quant_row_bytes(gate_up_qtype, H) > 0 && pagedllm::quant_row_bytes(down_qtype, I) > 0,
              "moe_experts: unsupported expert types ", gate_up_qtype, ", ", down_qtype);
  for (const auto& [b, n] : {std::pair{&gate_up_bias, 2 * I}, std::pair{&down_bias, H}})
    TORCH_CHECK(!b->has_value() || ((*b)->scalar_type() == at::kFloat && (*b)->is_contiguous() && (*b)->dim() == 2 &&
                                    (*b)->size(0) == E && (*b)->size(1) == n),
                "moe_experts: biases must be contiguous fp32 [E, 2I] (gate_up) and [E, H] (down)");
  const float* gub = gate_up_bias ? gate_up_bias->data_ptr<float>() : nullptr;
  const float* db = down_bias ? down_bias->data_ptr<float>() : nullptr;
  const int64_t* ex = experts.data_ptr<int64_t>();
  const float* wt = weights.data_ptr<float>();
  const int64_t* gup = gate_up_ptrs.data_ptr<int64_t>();
  const int64_t* dp = down_ptrs.data_ptr<int64_t>();
  const bool x_f32 = x.scalar_type() == at::kFloat;
  const size_t xsz = x_f32 ? 4 : 2;

  // (token, slot) pairs grouped by expert, each group in token order: a stable counting sort
  std::vector<int64_t> count(E + 1, 0), order(T * k);
  for (int64_t i = 0; i < T * k; ++i) {
    TORCH_CHECK(ex[i] >= 0 && ex[i] < E, "moe_experts: expert ", ex[i], " of ", E);
    ++count[ex[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  {
    std::vector<int64_t> at(count.begin(), count.end() - 1);
    for (int64_t i = 0; i < T * k; ++i) order[at[ex[i]]++] = i;
  }
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) most = std::max(most, count[e + 1] - count[e]);

  // slot i = t * k + j: y of token t's j-th expert times its weight (every slot is written below)
  std::unique_ptr<float[]> slot_buffer(new float[T * k * H]);
  float* slots = slot_buffer.get();
  const char* xp = static_cast<const char*>(x.data_ptr());
  // Expert e's n rows (the (token, slot) pairs idx) through its MLP into their slots, with buffers for n rows.
  const auto run = [&](int64_t e, int64_t n, const int64_t* idx, char* xs, float* gu, float* h, float* y) {
    for (int64_t r = 0; r < n; ++r) std::memcpy(xs + r * H * xsz, xp + idx[r] / k * H * xsz, H * xsz);
    pagedllm::quant_gemm_raw(xs, x_f32, reinterpret_cast<const uint8_t*>(gup[e]), gate_up_qtype, gu, true, n, 2 * I,
                             H, 2 * I);
    at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float* g = gu + r * 2 * I;
        for (int64_t i = 0; i < I; ++i) {
          const float gi = gub ? g[i] + gub[e * 2 * I + i] : g[i];
          const float ui = gub ? g[I + i] + gub[e * 2 * I + I + i] : g[I + i];
          h[r * I + i] = glu(glu_kind, gi, ui, static_cast<float>(limit), static_cast<float>(alpha));
        }
      }
    });
    pagedllm::quant_gemm_raw(h, true, reinterpret_cast<const uint8_t*>(dp[e]), down_qtype, y, true, n, H, I, H);
    for (int64_t r = 0; r < n; ++r) {
      const float w = wt[idx[r]];
      float* s = slots + idx[r] * H;
      const float* yr = y + r * H;
      for (int64_t c = 0; c < H; ++c) s[c] = (db ? yr[c] + db[e * H + c] : yr[c]) * w;
    }
  };
  std::vector<int64_t> chosen;  // an expert no token chose costs nothing
  for (int64_t e = 0; e < E; ++e)
    if (count[e + 1] > count[e]) chosen.push_back(e);
  if (most <= kSideBySideRows) {
    // Few rows per expert (decode steps, a lone one or a batch): the experts side by side, each on one thread at
    // a time, in one balanced parallel region (each GEMM alone would be its own region, a small matrix split
    // across the threads). Expert e's buffers are rows count[e].. of buffers for all T * k rows.
    const int64_t G = static_cast<int64_t>(chosen.size()), rows = T * k;
    std::vector<char> xs(rows * H * xsz);
    std::vector<float> gu(rows * 2 * I), h(rows * I), y(rows * H);
    pagedllm::parallel_balanced(G, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t e = chosen[g], r = count[e];
        run(e, count[e + 1] - r, order.data() + r, xs.data() + r * H * xsz, gu.data() + r * 2 * I, h.data() + r * I,
            y.data() + r * H);
      }
    });
  } else {
    std::vector<char> xs(most * H * xsz);
    std::vector<float> gu(most * 2 * I), h(most * I), y(most * H);
    for (int64_t e : chosen)
      run(e, count[e + 1] - count[e], order.data() + count[e], xs.data(), gu.data(), h.data(), y.data());
  }
  at::Tensor out = at::empty({T, H}, x.options());
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> sum(H);
    for (int64_t t = t0; t < t1; ++t) {
      std::copy_n(slots + t * k * H, H, sum.data());
      for (int64_t j = 1; j < k; ++j) {  // slot order: the same sum for a token in every batch
        const float* s = slots + (t * k + j) * H;
        for (int64_t c = 0; c < H; ++c) sum[c] += s[c];
      }
      if (x_f32) {
        std::copy_n(sum.data(), H, out.data_ptr<float>() + t * H);
      } else {
        uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr()) + t * H;
        for (int64_t c = 0; c < H; ++c) o[c] = pagedllm::f32_to_bf16(sum[c]);
      }
    }
  });
  return out;
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) { m.def("moe_experts", &pagedllm::moe_experts); }
