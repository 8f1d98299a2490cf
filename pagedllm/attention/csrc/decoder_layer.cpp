// One Llama decoder layer in one call, for decode-sized bf16 batches (a few tokens).
//
// A decode token of a small model is ~8 ms of weight streaming plus, layer by layer in Python, ~50 small torch
// ops per layer (norms, RoPE, splits, casts, adds): ~5 ms of dispatch for 30 layers. Here the pointwise work
// (RMSNorm, biases, q/k norms, RoPE, the K/V write, the SiLU gate, residual adds) is plain loops over the few
// rows, and the linears and attention call the small-GEMM and paged-attention kernels directly. Each step
// rounds to bf16 where the torch path does (every bf16 op rounds its result), so the two agree to a bf16 ulp
// (the reductions of the norms and the GEMMs sum in a different order).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "kernels.h"

namespace {

using pagedllm::bf16_to_f32;
using pagedllm::f32_to_bf16;
using Bf16 = uint16_t;

inline Bf16 mul(Bf16 a, Bf16 b) { return f32_to_bf16(bf16_to_f32(a) * bf16_to_f32(b)); }
inline Bf16 add(Bf16 a, Bf16 b) { return f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b)); }

const Bf16* bf16_data(const at::Tensor& t) { return reinterpret_cast<const Bf16*>(t.data_ptr()); }
Bf16* bf16_data(at::Tensor& t) { return reinterpret_cast<Bf16*>(t.data_ptr()); }

// y = w * (x * rsqrt(mean(x^2) + eps)) as transformers does it: statistics in fp32, normalised x rounded to bf16
// before the weight multiplies it. y may alias x.
void rms_norm(const Bf16* x, const Bf16* w, Bf16* y, int64_t n, float eps) {
  float sum_sq = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = bf16_to_f32(x[i]);
    sum_sq += v * v;
  }
  const float r = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = mul(w[i], f32_to_bf16(bf16_to_f32(x[i]) * r));
}

// x * cos + rotate_half(x) * sin over one head of d elements, in place (rotate-half convention).
void rope(Bf16* x, const Bf16* cos, const Bf16* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const Bf16 a = x[i], b = x[i + half];
    const Bf16 neg_b = static_cast<Bf16>(b ^ 0x8000u);
    x[i] = add(mul(a, cos[i]), mul(neg_b, sin[i]));
    x[i + half] = add(mul(b, cos[i + half]), mul(a, sin[i + half]));
  }
}

void check_weight(const at::Tensor& w, int64_t rows, int64_t cols, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous(), "decoder_layer_bf16: ", name,
              " must be contiguous bf16");
  TORCH_CHECK(w.dim() == (cols ? 2 : 1) && w.size(0) == rows && (!cols || w.size(1) == cols),
              "decoder_layer_bf16: ", name, " has the wrong shape");
}

// h [M, H] is updated in place: h += attn(norm(h)); h += mlp(norm(h)). The new K/V are written into the caches
// at slot_mapping before attention reads them.
void decoder_layer_bf16(at::Tensor h, const at::Tensor& input_norm, const at::Tensor& qkv_w,
                        const std::optional<at::Tensor>& qkv_b, const std::optional<at::Tensor>& q_norm,
                        const std::optional<at::Tensor>& k_norm, const at::Tensor& o_w,
                        const std::optional<at::Tensor>& o_b, const at::Tensor& post_norm,
                        const at::Tensor& gate_up_w, const at::Tensor& down_w, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        const at::Tensor& query_start_loc, int64_t num_heads, double eps, double scale) {
  TORCH_CHECK(pagedllm::small_gemm_available(), "decoder_layer_bf16 needs the avx512_bf16 small GEMM");
  TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.dim() == 2 && h.is_contiguous(),
              "decoder_layer_bf16: h must be contiguous bf16 [tokens, hidden]");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "decoder_layer_bf16: K/V caches must be contiguous bf16 [blocks, block_size, kv_heads, head_dim]");
  const int64_t M = h.size(0), H = h.size(1), hkv = k_cache.size(2), d = k_cache.size(3);
  const int64_t q_size = num_heads * d, kv_size = hkv * d, qkv_size = q_size + 2 * kv_size;
  const int64_t inter = down_w.size(1);
  check_weight(input_norm, H, 0, "input_norm");
  check_weight(post_norm, H, 0, "post_norm");
  check_weight(qkv_w, qkv_size, H, "qkv");
  check_weight(o_w, H, q_size, "o");
  check_weight(gate_up_w, 2 * inter, H, "gate_up");
  check_weight(down_w, H, inter, "down");
  if (qkv_b) check_weight(*qkv_b, qkv_size, 0, "qkv_bias");
  if (o_b) check_weight(*o_b, H, 0, "o_bias");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decoder_layer_bf16: q_norm and k_norm go together");
  if (q_norm) check_weight(*q_norm, d, 0, "q_norm"), check_weight(*k_norm, d, 0, "k_norm");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == M * d && sin.numel() == M * d,
              "decoder_layer_bf16: cos/sin must be contiguous bf16 with tokens x head_dim elements");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == M,
              "decoder_layer_bf16: slot_mapping must be contiguous int64 [tokens]");

  Bf16* hp = bf16_data(h);
  const float epsf = static_cast<float>(eps);
  std::vector<Bf16> x(M * std::max(H, inter)), qkv(M * qkv_size), gate_up(M * 2 * inter), proj(M * H);
  auto residual_add = [&] {  // h += proj, with an optional bias already folded into proj
    for (int64_t i = 0; i < M * H; ++i) hp[i] = add(hp[i], proj[i]);
  };

  // Attention block.
  for (int64_t m = 0; m < M; ++m) rms_norm(hp + m * H, bf16_data(input_norm), x.data() + m * H, H, epsf);
  pagedllm::small_gemm_bf16_raw(x.data(), bf16_data(qkv_w), qkv.data(), M, qkv_size, H);
  at::Tensor q = at::empty({M, num_heads, d}, h.options());
  Bf16* qp = bf16_data(q);
  Bf16* kc = bf16_data(k_cache);
  Bf16* vc = bf16_data(v_cache);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const Bf16* qkv_bias = qkv_b ? bf16_data(*qkv_b) : nullptr;
  for (int64_t m = 0; m < M; ++m) {
    Bf16* row = qkv.data() + m * qkv_size;
    if (qkv_bias)
      for (int64_t i = 0; i < qkv_size; ++i) row[i] = add(row[i], qkv_bias[i]);
    const Bf16* c = bf16_data(cos) + m * d;
    const Bf16* s = bf16_data(sin) + m * d;
    for (int64_t head = 0; head < num_heads + hkv; ++head) {  // q heads, then k heads: contiguous in the row
      Bf16* x_head = row + head * d;
      if (q_norm) rms_norm(x_head, bf16_data(head < num_heads ? *q_norm : *k_norm), x_head, d, epsf);
      rope(x_head, c, s, d);
    }
    std::memcpy(qp + m * q_size, row, q_size * sizeof(Bf16));
    const int64_t slot = slots[m];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "decoder_layer_bf16: slot ", slot, " out of range");
    std::memcpy(kc + slot * kv_size, row + q_size, kv_size * sizeof(Bf16));
    std::memcpy(vc + slot * kv_size, row + q_size + kv_size, kv_size * sizeof(Bf16));
  }
  at::Tensor attn = at::empty_like(q);
  pagedllm::paged_attention(attn, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, 0, 0);
  pagedllm::small_gemm_bf16_raw(bf16_data(attn), bf16_data(o_w), proj.data(), M, H, q_size);
  if (o_b) {
    const Bf16* o_bias = bf16_data(*o_b);
    for (int64_t i = 0; i < M * H; ++i) proj[i] = add(proj[i], o_bias[i % H]);
  }
  residual_add();

  // MLP block: down(silu(gate) * up), gate and up fused in one weight.
  for (int64_t m = 0; m < M; ++m) rms_norm(hp + m * H, bf16_data(post_norm), x.data() + m * H, H, epsf);
  pagedllm::small_gemm_bf16_raw(x.data(), bf16_data(gate_up_w), gate_up.data(), M, 2 * inter, H);
  for (int64_t m = 0; m < M; ++m) {
    const Bf16* g = gate_up.data() + m * 2 * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float gf = bf16_to_f32(g[i]);
      x[m * inter + i] = mul(f32_to_bf16(gf / (1.f + std::exp(-gf))), g[inter + i]);
    }
  }
  pagedllm::small_gemm_bf16_raw(x.data(), bf16_data(down_w), proj.data(), M, H, inter);
  residual_add();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) { m.def("decoder_layer_bf16", &decoder_layer_bf16); }
