// Quantized GGUF linears (see quant_gemm.h for the scheme): unpack the weight row, dot it with int8 activations.
//
// Layout of the per-call buffers (K rounded up to K64, a multiple of 64, zero padded: padding adds exact zeros):
//   weight row n: q[K64] u8 codes in element order, s16[K64/16], o16[K64/16] fp32 (w = s * q + o)
//   activation row m: a[K64] s8, al[K64/4] fp32 scale per 4 elements (one vpdpbusd lane), ao16[K64/16] fp32
//   (scale x sum of the 16 codes, for the offset term)
// out[m, n] = sum over 64-chunks of cvt(dpbusd(q, a)) * (s_lane * al) in 16 fp32 lanes, reduced in a fixed
// order, plus sum_b o16[b] * ao16[b]. Both the VNNI and the portable path compute exactly these products; only
// their final summation order differs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "quant_gemm.h"


namespace pagedllm {
namespace {

// A raw field (quant_types.h) as a float.
inline float field_value(Field f, uint16_t raw) {
  switch (f) {
    case Field::kF16: return f16_to_f32(raw);
    case Field::kU8:
    case Field::kLo4:
    case Field::kHi4: return static_cast<float>(raw);  // decode gives each nibble on its own
    case Field::kE8M0Half: return e8m0_half(static_cast<uint8_t>(raw));
    default: return static_cast<float>(static_cast<int8_t>(raw));
  }
}

// ---- weight unpacking: one file block into dot operands q and a scale and offset per 16 elements ---------------
template <class T>
inline void unpack_block(const uint8_t* b, uint8_t* q, float* s16, float* o16) {
  constexpr int kNumPer32 = sizeof(T::kPer32) / sizeof(Field);
  uint8_t codes[T::kBlock];
  uint16_t head_raw[T::kNumHead + 1], per32_raw[T::kBlock / 32 * kNumPer32];
  T::decode(b, codes, head_raw, per32_raw);
  for (int64_t e = 0; e < T::kBlock; ++e) q[e] = static_cast<uint8_t>(operand<T::kCodes>(codes[e]));
  float head[T::kNumHead + 1];
  for (int f = 0; f < T::kNumHead; ++f) head[f] = field_value(T::kHead[f], head_raw[f]);
  for (int64_t blk = 0; blk < T::kBlock / 32; ++blk) {
    float f[kNumPer32], ws[T::kHalves], wo[T::kHalves];
    for (int i = 0; i < kNumPer32; ++i) f[i] = field_value(T::kPer32[i], per32_raw[blk * kNumPer32 + i]);
    T::template scales<float>(head, f, ws, wo);
    for (int h = 0; h < 2; ++h) s16[2 * blk + h] = ws[h % T::kHalves], o16[2 * blk + h] = wo[h % T::kHalves];
  }
}

struct WeightRow {
  std::vector<uint8_t> q;
  std::vector<float> s16, o16;
  void resize(int64_t k64) { q.assign(k64, 0), s16.assign(k64 / 16, 0.f), o16.assign(k64 / 16, 0.f); }
};

void unpack_row(int64_t t, const uint8_t* row, int64_t K, WeightRow& w) {
  visit_type(t, [&](auto tag) {
    using T = typename decltype(tag)::traits;
    for (int64_t i = 0, k = 0; k < K; ++i, k += T::kBlock)
      unpack_block<T>(row + i * T::kBytes, w.q.data() + k, w.s16.data() + k / 16, w.o16.data() + k / 16);
  });
}

// ---- activation quantization ----------------------------------------------------------------------------
struct ActRows {
  int64_t k64 = 0;
  std::vector<int8_t> a;
  std::vector<float> al, ao16;
};

void quantize_row(const void* x, bool x_f32, int64_t K, int8_t* a, float* al, float* ao16) {
  float v[32];
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t n = std::min<int64_t>(32, K - k);
    float amax = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      v[i] = x_f32 ? static_cast<const float*>(x)[k + i] : bf16_to_f32(static_cast<const uint16_t*>(x)[k + i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sums[2] = {0, 0};
    for (int64_t i = 0; i < 32; ++i) {
      const int qi = i < n ? static_cast<int>(std::nearbyint(v[i] * inv)) : 0;
      a[k + i] = static_cast<int8_t>(qi);
      sums[i / 16] += qi;
    }
    for (int l = 0; l < 8; ++l) al[k / 4 + l] = d;
    ao16[k / 16] = d * sums[0], ao16[k / 16 + 1] = d * sums[1];
  }
}

void quantize_rows(const void* x, bool x_f32, int64_t M, int64_t K, ActRows& acts) {
  acts.k64 = (K + 63) / 64 * 64;
  acts.a.assign(M * acts.k64, 0), acts.al.assign(M * acts.k64 / 4, 0.f), acts.ao16.assign(M * acts.k64 / 16, 0.f);
  const int64_t esize = x_f32 ? 4 : 2;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(static_cast<const char*>(x) + m * K * esize, x_f32, K, acts.a.data() + m * acts.k64,
                   acts.al.data() + m * acts.k64 / 4, acts.ao16.data() + m * acts.k64 / 16);
  });
}

// ---- dot kernels: NR weight rows x MR activation rows, each output on its own accumulators ---------------------
void store_out(void* out, bool out_f32, int64_t idx, float v) {
  if (out_f32)
    static_cast<float*>(out)[idx] = v;
  else
    static_cast<uint16_t*>(out)[idx] = f32_to_bf16(v);
}

// sum_b o16[b] * ao16[b] in 16 lanes (b mod 16), then the lanes in order: the same in both builds
float offset_term(const float* o16, const float* ao16, int64_t nb) {
#if PL_VNNI
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 m = nb - b >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (nb - b)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, o16 + b), _mm512_maskz_loadu_ps(m, ao16 + b), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float lanes[16] = {};
  for (int64_t b = 0; b < nb; ++b) lanes[b % 16] += o16[b] * ao16[b];
  float s = 0.f;
  for (float v : lanes) s += v;
  return s;
#endif
}

// A weight row read 64 elements at a time: codes q and lane scales s per chunk; o16() its per-16 offsets once
// every chunk was read. BufferedRow reads an unpacked row (any type, any batch size).
struct BufferedRow {
  const WeightRow* w;
  const float* o16() const { return w->o16.data(); }
#if PL_VNNI
  void chunk(int64_t k, __m512i& q, __m512& s) const {
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    q = _mm512_loadu_si512(w->q.data() + k);
    s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(w->s16.data() + k / 16)));
  }
#endif
};

#if PL_VNNI
template <int NR, int MR, class Src>
void dot_tile(Src* w, const ActRows& acts, int64_t m0, float (*res)[MR]) {
  const int64_t k64 = acts.k64;
  __m512 acc[NR][MR];  // the loops over r and j are unrolled so that acc[][] stays in registers
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k64; k += 64) {
    __m512i q[NR];
    __m512 s[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) w[r].chunk(k, q[r], s[r]);
#pragma GCC unroll 8
    for (int j = 0; j < MR; ++j) {
      const int64_t row = (m0 + j) * k64;
      const __m512i a = _mm512_loadu_si512(acts.a.data() + row + k);
      const __m512 al = _mm512_loadu_ps(acts.al.data() + (row + k) / 4);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[r], a);
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s[r], al), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < MR; ++j)
      res[r][j] = _mm512_reduce_add_ps(acc[r][j]) +
                  offset_term(w[r].o16(), acts.ao16.data() + (m0 + j) * k64 / 16, k64 / 16);
}
#else
template <int NR, int MR, class Src>
void dot_tile(Src* src, const ActRows& acts, int64_t m0, float (*res)[MR]) {
  const int64_t k64 = acts.k64;
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < MR; ++j) {
      const WeightRow* w = src[r].w;
      const int64_t row = (m0 + j) * k64;
      float acc[16] = {};
      for (int64_t k = 0; k < k64; k += 64)
        for (int l = 0; l < 16; ++l) {
          int32_t dot = 0;
          for (int i = 0; i < 4; ++i) dot += int32_t(w->q[k + 4 * l + i]) * acts.a[row + k + 4 * l + i];
          acc[l] += float(dot) * (w->s16[k / 16 + l / 4] * acts.al[(row + k) / 4 + l]);
        }
      float sum = 0.f;
      for (float v : acc) sum += v;
      res[r][j] = sum + offset_term(w->o16.data(), acts.ao16.data() + row / 16, k64 / 16);
    }
}
#endif

template <int NR, class Src>
void dot_rows(Src* w, const ActRows& acts, int64_t M, int64_t n, void* out, bool out_f32, int64_t ldo) {
  constexpr int MR = 4;
  int64_t m = 0;
  for (; m + MR <= M; m += MR) {
    float res[NR][MR];
    dot_tile<NR, MR>(w, acts, m, res);
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < MR; ++j) store_out(out, out_f32, (m + j) * ldo + n + r, res[r][j]);
  }
  for (; m < M; ++m) {
    float res[NR][1];
    dot_tile<NR, 1>(w, acts, m, res);
    for (int r = 0; r < NR; ++r) store_out(out, out_f32, m * ldo + n + r, res[r][0]);
  }
}

constexpr int kNR = 2;  // weight rows per tile

// Rows n0..n1 through an unpacked copy of each weight row (reused by every activation row).
void rows_buffered(int64_t t, const uint8_t* w, int64_t row_bytes, const ActRows& acts, int64_t M, int64_t K,
                   int64_t n0, int64_t n1, void* out, bool out_f32, int64_t ldo) {
  thread_local WeightRow buf[kNR];
  for (auto& b : buf)
    if (static_cast<int64_t>(b.q.size()) != acts.k64) b.resize(acts.k64);
  BufferedRow rows[kNR] = {{&buf[0]}, {&buf[1]}};
  int64_t n = n0;
  for (; n + kNR <= n1; n += kNR) {
    for (int r = 0; r < kNR; ++r) unpack_row(t, w + (n + r) * row_bytes, K, buf[r]);
    dot_rows<kNR>(rows, acts, M, n, out, out_f32, ldo);
  }
  for (; n < n1; ++n) {
    unpack_row(t, w + n * row_bytes, K, buf[0]);
    dot_rows<1>(rows, acts, M, n, out, out_f32, ldo);
  }
}

}  // namespace

bool quant_type_supported(int64_t qtype) {
  return visit_type(qtype, [](auto) {});
}

int64_t quant_row_bytes(int64_t qtype, int64_t K) {
  if (qtype >= kPackedBase) return packed_row_bytes(qtype - kPackedBase, K);
  int64_t bytes = 0;
  visit_type(qtype, [&](auto tag) {
    using T = typename decltype(tag)::traits;
    if (K % T::kBlock == 0) bytes = K / T::kBlock * T::kBytes;
  });
  return bytes;
}

void quant_gemm_raw(const void* x, bool x_f32, const uint8_t* w, int64_t qtype, void* out, bool out_f32,
                    int64_t M, int64_t N, int64_t K, int64_t ldo) {
  if (qtype >= kPackedBase) return quant_gemm_packed(x, x_f32, w, qtype - kPackedBase, out, out_f32, M, N, K, ldo);
  const int64_t row_bytes = quant_row_bytes(qtype, K);
  TORCH_CHECK(row_bytes > 0, "quant_gemm: unsupported type ", qtype, " or K ", K, " not a multiple of its block");
  if (M == 0 || N == 0) return;
  ActRows acts;
  quantize_rows(x, x_f32, M, K, acts);
  // Grain: ~32 KiB of stored weights per task (decode); at least a tile of rows.
  const int64_t grain = std::max<int64_t>(kNR, (32768 / std::max<int64_t>(row_bytes, 1)) / kNR * kNR);
  parallel_balanced((N + kNR - 1) / kNR, grain / kNR, [&](int64_t t0, int64_t t1) {
    rows_buffered(qtype, w, row_bytes, acts, M, K, t0 * kNR, std::min(N, t1 * kNR), out, out_f32, ldo);
  });
}

}  // namespace pagedllm

namespace {

// out [M, N] (bf16 or fp32) = x [M, K] (bf16 or fp32) @ w^T, w: uint8 [N, row_bytes] in ggml type `qtype`.
void quant_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "quant_gemm: x must be contiguous bf16/fp32 [M, K]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == w.size(0) &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "quant_gemm: out must be bf16/fp32 [M, N] with unit column stride");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
                  w.size(1) == pagedllm::quant_row_bytes(qtype, x.size(1)),
              "quant_gemm: w must be contiguous uint8 [N, row bytes of type ", qtype, " for K = ", x.size(1), "]");
  pagedllm::quant_gemm_raw(x.data_ptr(), x.scalar_type() == at::kFloat, w.data_ptr<uint8_t>(), qtype,
                           out.data_ptr(), out.scalar_type() == at::kFloat, x.size(0), w.size(0), x.size(1),
                           out.stride(0));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("quant_gemm", &quant_gemm);
}
