// A model's decoder layers in one call (DecoderStack.forward), for bf16 models and fp32 models with quantized
// weights on the C++ attention backend (the element type T is Bf16 or float; pointwise stages round as torch does
// in that type). Two layer styles (Style below): Llama's, and Gemma 3's (norms scale by 1 + w in fp32, a norm after
// attention and after the MLP too, a GeGLU MLP).
//
// Layer by layer in Python a bf16 layer is ~50 torch ops: for a decode token of a small model their dispatch
// costs as much as streaming the weights (`pagedllm bench compile` compares the two), and for prefill and large
// batches the norms, RoPE and SiLU gate each make several passes over fp32 temporaries. Here the pointwise work
// (RMSNorm, biases, q/k norms, RoPE, the K/V write, the SiLU gate, residual adds) is one vectorised pass per
// stage over the rows, in parallel; the linears are the small-GEMM kernel (a few rows) or oneDNN's matmul, and
// attention is the paged kernel reading q in place from the QKV buffer.
//
// Rounding follows the torch path op by op (every bf16 op rounds its result to bf16, round-to-nearest-even), so
// the two agree to a bf16 ulp where reductions (norms, GEMMs) sum in a different order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "common.h"
#include "quant_gemm.h"


namespace {

// kLlama: norms y = w * T(x / rms(x)), SwiGLU; kGemma: norms y = T(x / rms(x) * (1 + w)), GeGLU (gelu tanh).
enum Style : int64_t { kLlama = 0, kGemma = 1 };

// The fp32 layer runs where the build has AVX-512 (16 lanes) or AVX2 + FMA (8 lanes); the bf16 one with
// avx512_bf16. The pointwise stages below are written once over Vec, Mask and the few operations they use.
#define PL_FUSED_LAYER (PL_AVX512 || PL_AVX2)

using Bf16 = uint16_t;

template <typename T>
T* data(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

#if PL_FUSED_LAYER
constexpr int64_t kRowsPerTask = 16;  // rows per parallel task of the pointwise stages

#if PL_AVX512
using Vec = __m512;
using Mask = __mmask16;
constexpr int64_t kLanes = 16;

inline Mask tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << remaining) - 1u);
}

inline Vec set1(float f) { return _mm512_set1_ps(f); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec negate(Vec a) { return _mm512_xor_ps(a, _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN))); }
inline float sum_lanes(Vec a) { return _mm512_reduce_add_ps(a); }

// load / store / round_as (what storing in T and loading back gives), overloaded on the element type
inline Vec load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline void store(float* p, Vec v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
#if PL_AVX512_BF16
inline Vec load(const Bf16* p, Mask m) { return pagedllm::widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }

inline void store(Bf16* p, Vec v, Mask m) {
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

inline Vec round_as(const Bf16*, Vec v) { return pagedllm::widen_bf16(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v))); }
#endif
#else  // AVX2 + FMA: fp32 only
using Vec = __m256;
struct Mask {
  __m256i lanes;  // lanes < remaining have their top bit set
  bool full;      // all 8: plain loads and stores (the masked ones are slow on some cores)
};
constexpr int64_t kLanes = 8;

inline Mask tail_mask(int64_t remaining) {
  const int32_t n = static_cast<int32_t>(std::min<int64_t>(remaining, 8));
  return {_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), n == 8};
}

inline Vec set1(float f) { return _mm256_set1_ps(f); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec negate(Vec a) { return _mm256_xor_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))); }
inline float sum_lanes(Vec a) { return pagedllm::sum8(a); }

inline Vec load(const float* p, Mask m) { return m.full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m.lanes); }

inline void store(float* p, Vec v, Mask m) {
  if (m.full) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, m.lanes, v);
  }
}
#endif
inline Vec round_as(const float*, Vec v) { return v; }

// rsqrt(mean(x^2) + eps) over n elements, in fp32, in every lane.
template <typename T>
Vec inv_rms(const T* x, int64_t n, float eps) {
  Vec sum = set1(0.f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const Vec v = load(x + i, tail_mask(n - i));
    sum = fmadd(v, v, sum);
  }
  return set1(1.f / std::sqrt(sum_lanes(sum) / static_cast<float>(n) + eps));
}

// Llama's RMSNorm: y = w * T(x * rsqrt(mean(x^2) + eps)), statistics in fp32, as transformers computes it. Gemma's
// (kGemma): y = T(x * rsqrt(mean(x^2) + eps) * (1 + w)), all in fp32 and rounded once, as Gemma3RMSNorm computes it.
// y may alias x.
template <typename T>
void rms_norm(Style style, const T* x, const T* w, T* y, int64_t n, float eps) {
  const Vec r = inv_rms(x, n, eps), one = set1(1.f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(n - i);
    const Vec xr = mul(load(x + i, m), r);
    store(y + i, style == kGemma ? mul(xr, add(one, load(w + i, m))) : mul(load(w + i, m), round_as(y, xr)), m);
  }
}

// x * cos + rotate_half(x) * sin over one head of d elements, in place; each product and the sum rounded.
template <typename T>
void rope(T* x, const T* cos, const T* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += kLanes) {
    const Mask m = tail_mask(half - i);
    const Vec a = load(x + i, m), b = load(x + half + i, m);
    const Vec lo = add(round_as(x, mul(a, load(cos + i, m))), round_as(x, mul(negate(b), load(sin + i, m))));
    const Vec hi = add(round_as(x, mul(b, load(cos + half + i, m))), round_as(x, mul(a, load(sin + half + i, m))));
    store(x + i, lo, m);
    store(x + half + i, hi, m);
  }
}

// x += b (n elements); with a scale other than 1, x += T(b * scale) (Granite's residual multiplier, rounded as the
// torch layers round it)
template <typename T>
void add_into(T* x, const T* b, int64_t n, float scale = 1.f) {
  const Vec s = set1(scale);
  for (int64_t i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(n - i);
    const Vec bv = scale == 1.f ? load(b + i, m) : round_as(x, mul(load(b + i, m), s));
    store(x + i, add(load(x + i, m), bv), m);
  }
}

// out[i] = T(silu(g[i])) * u[i], rounded: F.silu(gate) * up on tensors of T.
template <typename T>
void silu_mul(const T* g, const T* u, T* out, int64_t n) {
  const Vec one = set1(1.f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(n - i);
    const Vec gv = load(g + i, m);
    const Vec silu = div(gv, add(one, pagedllm::exp_ps(negate(gv))));
    store(out + i, mul(round_as(out, silu), load(u + i, m)), m);
  }
}

// out[i] = T(gelu_tanh(g[i])) * u[i], rounded: F.gelu(gate, approximate="tanh") * up on tensors of T. gelu_tanh
// x = 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)), y = sqrt(2 / pi) (x + 0.044715 x^3): no cancellation for x << 0.
template <typename T>
void gelu_tanh_mul(const T* g, const T* u, T* out, int64_t n) {
  const Vec one = set1(1.f), minus_2beta = set1(-2.f * 0.7978845608028654f), kappa = set1(0.044715f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const Mask m = tail_mask(n - i);
    const Vec x = load(g + i, m);
    const Vec inner = fmadd(mul(kappa, x), mul(x, x), x);  // x + kappa x^3
    const Vec gelu = div(x, add(one, pagedllm::exp_ps(mul(minus_2beta, inner))));
    store(out + i, mul(round_as(out, gelu), load(u + i, m)), m);
  }
}

#endif

// A linear layer's weight: one dense bf16 [N, K] matrix, or row segments (q|k|v, gate|up: one per checkpoint
// tensor) each either dense bf16 (type kDense) or GGUF blocks, uint8 [n_i, row bytes] of ggml type types[i]
// (quant_gemm.h), writing output columns sum(n_<i) .. + n_i.
constexpr int64_t kDense = 0;

struct LinearWeight {
  std::vector<at::Tensor> segs;
  std::vector<int64_t> types;

  int64_t rows() const {
    int64_t n = 0;
    for (const auto& s : segs) n += s.size(0);
    return n;
  }
  bool dense() const { return segs.size() == 1 && types[0] == kDense; }
};

void check_linear(const LinearWeight& w, int64_t rows, int64_t cols, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(!w.segs.empty() && w.segs.size() == w.types.size() && w.rows() == rows, "decoder_layer: ", name,
              " has the wrong rows or segment list");
  for (size_t i = 0; i < w.segs.size(); ++i) {
    const at::Tensor& s = w.segs[i];
    const bool ok = w.types[i] == kDense
                        ? s.scalar_type() == dtype && s.dim() == 2 && s.size(1) == cols
                        : s.scalar_type() == at::kByte && s.dim() == 2 &&
                              s.size(1) == pagedllm::quant_row_bytes(w.types[i], cols);
    TORCH_CHECK(ok && s.is_contiguous(), "decoder_layer: ", name, " segment ", i, " is not contiguous ", dtype, " or ",
                "uint8 blocks of its type for ", cols, " inputs");
  }
}

#if PL_FUSED_LAYER
// out = x @ w^T (+ bias) like the model's linear(). In batch-invariant mode the fixed-order GEMM (the bias added
// after). Else bf16: the bandwidth-bound small GEMM for a few rows (the bias added to the rounded product),
// oneDNN's matmul beyond (the bias added before rounding, as F.linear does); fp32: oneDNN.
template <typename T>
void linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor& out,
            bool invariant) {
  const int64_t rows = x.size(0), n = w.size(0);
  if (invariant) {
    pagedllm::gemm_invariant_raw(x.data_ptr(), w.data_ptr(), out.data_ptr(), std::is_same_v<T, Bf16>, rows, n,
                                 w.size(1));
    if (bias) out.add_(*bias);
  } else if (std::is_same_v<T, Bf16> && rows <= pagedllm::kSmallGemmMaxRows) {
    pagedllm::small_gemm_bf16_raw(data<Bf16>(x), data<Bf16>(w), data<Bf16>(out), rows, n, w.size(1));
    if (bias)
      for (int64_t r = 0; r < rows; ++r) add_into(data<T>(out) + r * n, data<T>(*bias), n);
  } else if (bias) {
    at::addmm_out(out, *bias, x, w.t());
  } else {
    at::mm_out(out, x, w.t());
  }
}

// The same for a segmented weight: each quantized segment through quant_gemm into its columns (the bias added to
// the rounded product, as the model's quantized linear method does).
template <typename T>
void linear(const at::Tensor& x, const LinearWeight& w, const std::optional<at::Tensor>& bias, at::Tensor& out,
            bool invariant) {
  if (w.dense()) return linear<T>(x, w.segs[0], bias, out, invariant);
  constexpr bool f32 = std::is_same_v<T, float>;
  const int64_t rows = x.size(0), n = out.size(1);
  int64_t col = 0;
  for (size_t i = 0; i < w.segs.size(); ++i) {
    const at::Tensor& s = w.segs[i];
    if (w.types[i] == kDense) {
      at::Tensor part = at::empty({rows, s.size(0)}, out.options());
      linear<T>(x, s, std::nullopt, part, invariant);
      out.narrow(1, col, s.size(0)).copy_(part);
    } else {
      pagedllm::quant_gemm_raw(x.data_ptr(), f32, s.data_ptr<uint8_t>(), w.types[i], data<T>(out) + col, f32, rows,
                               s.size(0), x.size(1), n);
    }
    col += s.size(0);
  }
  if (bias)
    for (int64_t r = 0; r < rows; ++r) add_into(data<T>(out) + r * n, data<T>(*bias), n);
}

template <typename F>
void for_rows(int64_t rows, const F& f) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}
#endif

void check_weight(const at::Tensor& w, int64_t rows, int64_t cols, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(w.scalar_type() == dtype && w.is_contiguous(), "decoder_layer: ", name, " must be contiguous ", dtype);
  TORCH_CHECK(w.dim() == (cols ? 2 : 1) && w.size(0) == rows && (!cols || w.size(1) == cols),
              "decoder_layer: ", name, " has the wrong shape");
}

// Which decoder_layer<T> this build has: the fp32 one with AVX-512 or AVX2, the bf16 one with avx512_bf16.
bool has_layer(at::ScalarType dtype) {
  return dtype == at::kFloat ? PL_FUSED_LAYER : dtype == at::kBFloat16 && PL_AVX512_BF16;
}

// A stack of decoder layers whose weights are bound once (DecoderStack.add_layer, at the model's first fused
// forward): a step calls DecoderStack.forward once for all layers with only activations, caches and metadata.
// Passing each layer's arguments through the dispatcher, after the layer before had streamed its weights through
// the caches, cost a large share of a small model's decode step (BENCHMARKS.md, issue 29).
// post_norm is the norm before the MLP; attn_out_norm and mlp_out_norm (Gemma) normalise the attention's and the
// MLP's outputs before their residual adds. window: the layer's sliding window in keys (0: none); sinks: one
// logit per query head (gpt-oss). The MLP is gate_up and down, or a mixture of experts (DecoderStack.add_experts).
//
// A mixture of experts: the router's logits (a linear to E, with its bias), each token's top_k experts
// (route_row), and the experts in one moe_experts call (moe.cpp) with the table model/moe.py builds: their
// stored matrices' data pointers (the model holds the tensors), one ggml type per kind, fp32 biases [E, n], the
// glu's kind, limit and alpha.
struct Experts {
  LinearWeight router;
  std::optional<at::Tensor> router_b, gate_up_b, down_b;
  at::Tensor gate_up_ptrs, down_ptrs;
  int64_t gate_up_qtype, down_qtype, inter, top_k;
  bool renormalize;
  int64_t glu;
  double limit, alpha;
};

struct LayerWeights {
  at::Tensor input_norm, post_norm;
  LinearWeight qkv, o, gate_up, down;
  std::optional<at::Tensor> qkv_b, o_b, q_norm, k_norm, attn_out_norm, mlp_out_norm;
  int64_t window = 0;
  std::optional<at::Tensor> sinks;
  std::optional<Experts> experts;
};

struct DecoderStack : torch::CustomClassHolder {
  int64_t hidden, num_heads, num_kv_heads, head_dim, inter;
  double eps, scale, residual_scale;  // residual_scale: each branch's output times it before its add (Granite)
  at::Tensor final_norm;  // the model's norm after the last layer
  Style style;
  std::vector<LayerWeights> layers;

  DecoderStack(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter,
               double eps, double scale, at::Tensor final_norm, int64_t style, double residual_scale)
      : hidden(hidden), num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim), inter(inter),
        eps(eps), scale(scale), residual_scale(residual_scale), final_norm(final_norm),
        style(static_cast<Style>(style)) {
    TORCH_CHECK(hidden > 0 && num_heads > 0 && num_kv_heads > 0 && head_dim > 0 && inter > 0 &&
                    num_heads % num_kv_heads == 0, "DecoderStack: bad shape");
    TORCH_CHECK(style == kLlama || style == kGemma, "DecoderStack: unknown layer style ", style);
    TORCH_CHECK(has_layer(final_norm.scalar_type()), "DecoderStack: this build has no layer for ",
                final_norm.scalar_type());
    check_weight(final_norm, hidden, 0, final_norm.scalar_type(), "final_norm");
  }

  // Checks every weight against the stack's shape and dtype; (segs, types): LinearWeight (dense: one segment of type 0).
  void add_layer(at::Tensor input_norm, std::vector<at::Tensor> qkv_segs, std::vector<int64_t> qkv_types,
                 std::optional<at::Tensor> qkv_b, std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 std::vector<at::Tensor> o_segs, std::vector<int64_t> o_types, std::optional<at::Tensor> o_b,
                 at::Tensor post_norm, std::vector<at::Tensor> gate_up_segs, std::vector<int64_t> gate_up_types,
                 std::vector<at::Tensor> down_segs, std::vector<int64_t> down_types, int64_t window,
                 std::optional<at::Tensor> attn_out_norm, std::optional<at::Tensor> mlp_out_norm,
                 std::optional<at::Tensor> sinks) {
    const at::ScalarType dt = final_norm.scalar_type();  // every weight is of the stack's dtype
    const int64_t H = hidden, d = head_dim, q_size = num_heads * d, qkv_size = q_size + 2 * num_kv_heads * d;
    LayerWeights w{input_norm, post_norm, {qkv_segs, qkv_types}, {o_segs, o_types}, {gate_up_segs, gate_up_types},
                   {down_segs, down_types}, qkv_b, o_b, q_norm, k_norm, attn_out_norm, mlp_out_norm, window, sinks,
                   std::nullopt};
    TORCH_CHECK(window >= 0, "DecoderStack: window must be >= 0 (0: none), got ", window);
    TORCH_CHECK(w.attn_out_norm.has_value() == w.mlp_out_norm.has_value() &&
                    w.attn_out_norm.has_value() == (style == kGemma),
                "DecoderStack: the output norms go together, in Gemma's layer only");
    if (w.attn_out_norm) {
      check_weight(*w.attn_out_norm, H, 0, dt, "attn_out_norm");
      check_weight(*w.mlp_out_norm, H, 0, dt, "mlp_out_norm");
    }
    check_weight(w.input_norm, H, 0, dt, "input_norm");
    check_weight(w.post_norm, H, 0, dt, "post_norm");
    check_linear(w.qkv, qkv_size, H, dt, "qkv");
    check_linear(w.o, H, q_size, dt, "o");
    if (!w.gate_up.segs.empty() || !w.down.segs.empty()) {  // else experts come (add_experts)
      check_linear(w.gate_up, 2 * inter, H, dt, "gate_up");
      check_linear(w.down, H, inter, dt, "down");
    }
    TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                           sinks->size(0) == num_heads),
                "DecoderStack: sinks must be contiguous fp32 [", num_heads, "]");
    if (w.qkv_b) check_weight(*w.qkv_b, qkv_size, 0, dt, "qkv_bias");
    if (w.o_b) check_weight(*w.o_b, H, 0, dt, "o_bias");
    TORCH_CHECK(w.q_norm.has_value() == w.k_norm.has_value(), "DecoderStack: q_norm and k_norm go together");
    if (w.q_norm) check_weight(*w.q_norm, d, 0, dt, "q_norm"), check_weight(*w.k_norm, d, 0, dt, "k_norm");
    layers.push_back(std::move(w));
  }

  // The last added layer's MLP as a mixture of experts (its add_layer gave no gate_up and down); the table's
  // arguments as moe_experts takes them, which checks them again at every call.
  void add_experts(std::vector<at::Tensor> router_segs, std::vector<int64_t> router_types,
                   std::optional<at::Tensor> router_b, at::Tensor gate_up_ptrs, at::Tensor down_ptrs,
                   int64_t gate_up_qtype, int64_t down_qtype, int64_t expert_inter, std::optional<at::Tensor> gate_up_b,
                   std::optional<at::Tensor> down_b, int64_t glu, double limit, double alpha, int64_t top_k,
                   bool renormalize) {
    TORCH_CHECK(!layers.empty() && layers.back().gate_up.segs.empty() && !layers.back().experts,
                "DecoderStack.add_experts: the last layer must be added without its MLP");
    const at::ScalarType dt = final_norm.scalar_type();
    const int64_t E = gate_up_ptrs.numel();
    Experts x{{router_segs, router_types}, router_b, gate_up_b, down_b, gate_up_ptrs, down_ptrs, gate_up_qtype,
              down_qtype, expert_inter, top_k, renormalize, glu, limit, alpha};
    TORCH_CHECK(gate_up_ptrs.scalar_type() == at::kLong && down_ptrs.scalar_type() == at::kLong &&
                    gate_up_ptrs.is_contiguous() && down_ptrs.is_contiguous() && down_ptrs.numel() == E && E > 0,
                "DecoderStack.add_experts: one int64 gate_up and down pointer per expert");
    TORCH_CHECK(top_k > 0 && top_k <= E && expert_inter > 0, "DecoderStack.add_experts: top_k ", top_k, " of ", E,
                " experts of width ", expert_inter);
    check_linear(x.router, E, hidden, dt, "router");
    if (router_b) check_weight(*router_b, E, 0, dt, "router_bias");
    layers.back().experts = std::move(x);
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }
};

#if PL_FUSED_LAYER
// The per-step buffers of one call, shared by its layers.
struct Scratch {
  at::Tensor x, qkv, attn, proj, gate_up, act;
  Scratch(const DecoderStack& s, int64_t M, const at::TensorOptions& o)
      : x(at::empty({M, s.hidden}, o)),
        qkv(at::empty({M, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim}, o)),
        attn(at::empty({M, s.num_heads, s.head_dim}, o)),
        proj(at::empty({M, s.hidden}, o)),
        gate_up(at::empty({M, 2 * s.inter}, o)),
        act(at::empty({M, s.inter}, o)) {}
};

// h += experts(x), x [M, H] the MLP's normed input: the router's logits, each row's experts (in fp32, as
// model/moe.py routes), the experts in one call.
template <typename T>
void experts_block(const DecoderStack& s, const Experts& e, at::Tensor& h, const at::Tensor& x, bool invariant) {
  const int64_t M = h.size(0), H = s.hidden, E = e.gate_up_ptrs.numel(), k = e.top_k;
  at::Tensor logits = at::empty({M, E}, h.options());
  linear<T>(x, e.router, e.router_b, logits, invariant);
  at::Tensor experts = at::empty({M, k}, at::kLong), weights = at::empty({M, k}, at::kFloat);
  for_rows(M, [&](int64_t m) {
    const T* row = data<T>(logits) + m * E;
    int64_t* chosen = experts.data_ptr<int64_t>() + m * k;
    float* weight = weights.data_ptr<float>() + m * k;
    if constexpr (std::is_same_v<T, Bf16>) {  // widened, as model/moe.py routes logits.float()
      std::vector<float> f(E);
      for (int64_t i = 0; i < E; ++i) f[i] = pagedllm::bf16_to_f32(row[i]);
      pagedllm::route_row(f.data(), E, k, e.renormalize, chosen, weight);
    } else {
      pagedllm::route_row(row, E, k, e.renormalize, chosen, weight);
    }
  });
  const at::Tensor y = pagedllm::moe_experts(x, experts, weights, e.gate_up_ptrs, e.down_ptrs, e.gate_up_qtype,
                                             e.down_qtype, e.inter, e.gate_up_b, e.down_b, e.glu, e.limit, e.alpha);
  T* hp = data<T>(h);
  const float residual = static_cast<float>(s.residual_scale);
  for_rows(M, [&](int64_t m) { add_into(hp + m * H, data<T>(y) + m * H, H, residual); });
}

// h [M, H] is updated in place: h += attn(norm(h)); h += mlp(norm(h)). The new K/V are written into the caches
// at slots before attention reads them. invariant: batch-invariant GEMMs and attention (KernelMode).
template <typename T>
void decoder_layer(const DecoderStack& s, const LayerWeights& w, at::Tensor& h, Scratch& buf, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const int64_t* slots,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                   bool invariant) {
  const int64_t M = h.size(0), H = s.hidden, hkv = s.num_kv_heads, d = s.head_dim, num_heads = s.num_heads;
  const int64_t q_size = num_heads * d, kv_size = hkv * d, qkv_size = q_size + 2 * kv_size, inter = s.inter;
  const float epsf = static_cast<float>(s.eps), residual = static_cast<float>(s.residual_scale);
  const auto norm = [&](const T* x, const at::Tensor& weight, T* y, int64_t n) {
    rms_norm(s.style, x, data<T>(weight), y, n, epsf);
  };
  T* hp = data<T>(h);
  T *xp = data<T>(buf.x), *qkvp = data<T>(buf.qkv), *projp = data<T>(buf.proj), *gup = data<T>(buf.gate_up),
    *actp = data<T>(buf.act);

  // Attention block: norm, QKV, (bias, q/k norm,) RoPE on q and k, K/V into the cache, attention, O.
  for_rows(M, [&](int64_t m) { norm(hp + m * H, w.input_norm, xp + m * H, H); });
  linear<T>(buf.x, w.qkv, w.qkv_b, buf.qkv, invariant);
  T* kc = data<T>(k_cache);
  T* vc = data<T>(v_cache);
  for_rows(M, [&](int64_t m) {
    T* row = qkvp + m * qkv_size;
    for (int64_t head = 0; head < num_heads + hkv; ++head) {  // q heads, then k heads: contiguous in the row
      T* x_head = row + head * d;
      if (w.q_norm) norm(x_head, head < num_heads ? *w.q_norm : *w.k_norm, x_head, d);
      rope(x_head, data<T>(cos) + m * d, data<T>(sin) + m * d, d);
    }
    std::memcpy(kc + slots[m] * kv_size, row + q_size, kv_size * sizeof(T));
    std::memcpy(vc + slots[m] * kv_size, row + q_size + kv_size, kv_size * sizeof(T));
  });
  const at::Tensor q = buf.qkv.as_strided({M, num_heads, d}, {qkv_size, d, 1});  // read in place
  pagedllm::paged_attention(buf.attn, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, s.scale,
                            /*portable=*/false, invariant, 0, w.window, w.sinks);
  linear<T>(buf.attn.view({M, q_size}), w.o, w.o_b, buf.proj, invariant);
  for_rows(M, [&](int64_t m) {  // h += (the norm of) o; then the MLP's norm of the new h
    if (w.attn_out_norm) norm(projp + m * H, *w.attn_out_norm, projp + m * H, H);
    add_into(hp + m * H, projp + m * H, H, residual);
    norm(hp + m * H, w.post_norm, xp + m * H, H);
  });

  if (w.experts) return experts_block<T>(s, *w.experts, h, buf.x, invariant);
  // MLP block: down(act(gate) * up), gate and up fused in one weight.
  linear<T>(buf.x, w.gate_up, std::nullopt, buf.gate_up, invariant);
  for_rows(M, [&](int64_t m) {
    const T *g = gup + m * 2 * inter, *u = g + inter;
    s.style == kGemma ? gelu_tanh_mul(g, u, actp + m * inter, inter) : silu_mul(g, u, actp + m * inter, inter);
  });
  linear<T>(buf.act, w.down, std::nullopt, buf.proj, invariant);
  for_rows(M, [&](int64_t m) {
    if (w.mlp_out_norm) norm(projp + m * H, *w.mlp_out_norm, projp + m * H, H);
    add_into(hp + m * H, projp + m * H, H, residual);
  });
}
#endif

// Layers first .. first + count - 1 of the stack over h [M, H] (updated in place), all with the same attention
// metadata, then the final norm if the last layer was among them. kv_pool is the KV pool, [pool rows, 2 (K, V),
// blocks, block_size, KV heads, head_dim], and layer i's caches are kv_pool[pool_rows[i]] (pool_rows: int64, one per
// layer of the stack; with KV groups layers share rows). The pool is passed whole, not as per-layer lists: the
// dispatcher converted two lists of a tensor per layer on every call (BENCHMARKS.md, issue 29).
// h's dtype picks the layer (float, or bf16 where the build has avx512_bf16) and must be the weights'.
void stack_forward(const c10::intrusive_ptr<DecoderStack>& stack, at::Tensor h, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& kv_pool, const at::Tensor& pool_rows,
                   const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& query_start_loc, int64_t first, int64_t count, bool invariant) {
  const DecoderStack& s = *stack;
  const at::ScalarType dt = h.scalar_type();
  TORCH_CHECK(has_layer(dt), "DecoderStack.forward: this build has no layer for ", dt,
              " (the model runs its torch layers)");
  TORCH_CHECK(first >= 0 && count >= 0 && first + count <= s.size(), "DecoderStack.forward: layers ", first, "..",
              first + count, " of ", s.size());
  TORCH_CHECK(s.final_norm.scalar_type() == dt, "DecoderStack.forward: h is ", dt, ", the weights ",
              s.final_norm.scalar_type());
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.size(1) == s.hidden,
              "DecoderStack.forward: h must be contiguous [tokens, ", s.hidden, "]");
  const int64_t M = h.size(0), d = s.head_dim;
  TORCH_CHECK(cos.scalar_type() == dt && sin.scalar_type() == dt && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == M * d && sin.numel() == M * d,
              "DecoderStack.forward: cos/sin must be contiguous ", dt, " with tokens x head_dim elements");
  TORCH_CHECK(kv_pool.scalar_type() == dt && kv_pool.dim() == 6 && kv_pool.is_contiguous() && kv_pool.size(1) == 2 &&
                  kv_pool.size(4) == s.num_kv_heads && kv_pool.size(5) == d,
              "DecoderStack.forward: the KV pool must be contiguous ", dt, " [rows, 2, blocks, block_size, ",
              s.num_kv_heads, ", ", d, "]");
  TORCH_CHECK(pool_rows.scalar_type() == at::kLong && pool_rows.is_contiguous() && pool_rows.numel() == s.size(),
              "DecoderStack.forward: pool_rows must be contiguous int64 with one row per layer (", s.size(), ")");
  const int64_t* rows = pool_rows.data_ptr<int64_t>();
  for (int64_t i = first; i < first + count; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < kv_pool.size(0), "DecoderStack.forward: layer ", i, "'s pool row ",
                rows[i], " out of range");
    TORCH_CHECK(!s.layers[i].gate_up.segs.empty() || s.layers[i].experts, "DecoderStack.forward: layer ", i,
                " has no MLP (its experts were never added)");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == M,
              "DecoderStack.forward: slot_mapping must be contiguous int64 [tokens]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = kv_pool.size(2) * kv_pool.size(3);
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(slots[m] >= 0 && slots[m] < num_slots, "DecoderStack.forward: slot ", slots[m], " out of range");
#if PL_FUSED_LAYER
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    Scratch buf(s, M, h.options());
    for (int64_t i = first; i < first + count; ++i) {
      const at::Tensor kv = kv_pool.select(0, rows[i]);
      at::Tensor k_cache = kv.select(0, 0), v_cache = kv.select(0, 1);
      decoder_layer<T>(s, s.layers[i], h, buf, cos, sin, k_cache, v_cache, slots, block_tables, seq_lens,
                       query_start_loc, invariant);
    }
    if (count > 0 && first + count == s.size()) {  // the model's final norm, in place
      T* hp = data<T>(h);
      const int64_t H = s.hidden;
      for_rows(M, [&](int64_t m) { rms_norm(s.style, hp + m * H, data<T>(s.final_norm), hp + m * H, H, float(s.eps)); });
    }
  };
  if (dt == at::kFloat) return run(float{});
#if PL_AVX512_BF16
  run(Bf16{});
#endif
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor, int64_t, double>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("add_experts", &DecoderStack::add_experts)
      .def("__len__", &DecoderStack::size)
      .def("forward", &stack_forward);  // a method, not an op: an op taking the class checks every argument in Python
}
