// "dot" path (fp32 arithmetic): few query rows (decode, short prompt tails).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention.h"

#if PL_AVX512
#include "attention_avx512.h"

namespace pagedllm::attn {

// The dot path's chunk of keys as fp32 rows: float rows in place, bf16 and int8 rows widened into the scratch
// (int8 unscaled: the K scales go into the scores, the V scales into the probabilities). One KV head per item.
template <int ND>
struct WidenedChunk {
  static constexpr int D = ND * 16;
  const Problem& p;
  Scratch& s;
  const float* kr[kChunk];
  const float* vr[kChunk];
  alignas(64) float kscale[kChunk], vscale[kChunk];
  __m512 ksv, vsv;

  const int64_t h;

  WidenedChunk(const Problem& prob, const Item& it, Scratch& scratch, int64_t /*rows*/)
      : p(prob), s(scratch), h(it.h) {}
  void load(KeyCursor& cur, int64_t nk) {
    chunk_rows<ND>(p, h, cur, nk, false, s.kbuf.get(), s.vbuf.get(), kr, vr, kscale, vscale);
    ksv = p.kv_int8 ? _mm512_load_ps(kscale) : _mm512_set1_ps(1.f);
    vsv = p.kv_int8 ? _mm512_load_ps(vscale) : _mm512_set1_ps(1.f);
  }
  // Row i's 16 scores: 16 dot products reduced to one vector (times the keys' int8 scales: exact x 1 otherwise).
  __m512 scores(int64_t i, int64_t /*head*/) const {
    const float* q = s.qbuf.get() + i * D;
    __m512 qv[ND];
    for (int e = 0; e < ND; ++e) qv[e] = _mm512_loadu_ps(q + e * 16);
    __m512 sacc[kChunk];
    for (int j = 0; j < kChunk; ++j) {
      __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr[j]));
      for (int e = 1; e < ND; ++e) a = _mm512_fmadd_ps(qv[e], _mm512_loadu_ps(kr[j] + e * 16), a);
      sacc[j] = a;
    }
    return _mm512_mul_ps(reduce16(sacc), ksv);
  }
  __m512 prob_scale(int64_t /*head*/) const { return vsv; }
  const float* const* values(int64_t /*head*/) const { return vr; }
};

template <int ND>
void attend_dot(const Problem& p, const Item& it, Scratch& s, float* partials) {
  attend_dot_chunks<ND, WidenedChunk<ND>>(p, it, s, partials);
}
PA_INSTANTIATE(attend_dot)

}  // namespace pagedllm::attn
#endif
