// What the machine can do at most, for `pagedllm bench membw` (the roofline the GEMMs are measured against):
//   read_stream(buf): reads every byte of buf once across torch's threads (static split, as the GEMMs' N split)
//   and returns a checksum, so the reads cannot be dropped;
//   int8_dot_ops(iters): each thread runs `iters` rounds of independent vpdpbusd chains (enough to cover the
//   instruction's latency) and the op returns the int8 operations done (2 per multiply-add); 0 without VNNI;
//   amx_dot_ops(iters): the same for the AMX tile unit (4 independent 16 x 16 x 64 tdpbssd a round); 0 where it
//   cannot run (quant_gemm.h's amx_usable).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "isa.h"
#include "quant_gemm.h"

namespace {

int64_t read_stream(const at::Tensor& buf) {
  TORCH_CHECK(buf.is_contiguous(), "read_stream: a contiguous buffer");
  const uint8_t* p = static_cast<const uint8_t*>(buf.data_ptr());
  const int64_t lines = buf.nbytes() / 64;
  std::atomic<int64_t> total{0};
  at::parallel_for(0, lines, 4096, [&](int64_t l0, int64_t l1) {
#if PL_AVX512
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    int64_t l = l0;
    for (; l + 4 <= l1; l += 4)
      for (int i = 0; i < 4; ++i) acc[i] = _mm512_add_epi64(acc[i], _mm512_loadu_si512(p + (l + i) * 64));
    for (; l < l1; ++l) acc[0] = _mm512_add_epi64(acc[0], _mm512_loadu_si512(p + l * 64));
    total += _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(acc[0], acc[1]), _mm512_add_epi64(acc[2], acc[3])));
#else
    int64_t s = 0;
    for (int64_t l = l0; l < l1; ++l)
      for (int i = 0; i < 64; i += 8) {
        int64_t v;
        std::memcpy(&v, p + l * 64 + i, 8);
        s += v;
      }
    total += s;
#endif
  });
  return total.load();
}

int64_t int8_dot_ops(int64_t iters) {
#if PL_VNNI
  constexpr int kChains = 12;
  const int threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      __m512i acc[kChains];
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c);
      const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
      for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
      __m512i s = acc[0];
      for (int c = 1; c < kChains; ++c) s = _mm512_add_epi32(s, acc[c]);
      sink += _mm512_reduce_add_epi32(s);
    }
  });
  TORCH_CHECK(sink.load() != 42, "unreachable");  // keeps the chains
  return static_cast<int64_t>(threads) * iters * kChains * 64 * 2;
#else
  (void)iters;
  return 0;
#endif
}

int64_t amx_dot_ops(int64_t iters) {
#if PL_AMX
  if (!pagedllm::amx_usable()) return 0;
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } config;
  const int threads = at::get_num_threads();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) int8_t operands[16 * 64];
    for (int i = 0; i < 16 * 64; ++i) operands[i] = static_cast<int8_t>(i % 7 - 3);
    _tile_loadconfig(&config);
    for (int64_t t = t0; t < t1; ++t) {
      _tile_loadd(4, operands, 64); _tile_loadd(5, operands, 64); _tile_loadd(6, operands, 64);
      _tile_loadd(7, operands, 64);
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t i = 0; i < iters; ++i) {
        _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
      }
    }
    _tile_release();
  });
  return static_cast<int64_t>(threads) * iters * 4 * 16 * 16 * 64 * 2;
#else
  (void)iters;
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("read_stream", &read_stream);
  m.def("int8_dot_ops", &int8_dot_ops);
  m.def("amx_dot_ops", &amx_dot_ops);
}
