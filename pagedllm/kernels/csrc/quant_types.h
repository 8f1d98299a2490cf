// The GGUF block types the quantized GEMMs read: one traits struct per type (llama.cpp's type_traits is the model),
// and the one list of them (QuantTypes). Python's row of each type is in pagedllm/quantization/types.py; the
// quant_type_table op reports these so that a test holds the two equal.
//
// A type's traits say:
//   kBlock, kBytes        the file's block: elements and bytes
//   kCodes                how the packed form stores a weight's code (Codes below)
//   kHead, kPer32         the scale fields of each block (kHead: once per file block; kPer32: per 32 elements),
//                         as raw fp16 bits, bytes or nibbles (Field, which also says how a raw field reads as a float)
//   kHalves               scale groups per 32 elements: 1, or 2 where the type scales each 16 (Q2_K, Q3_K, Q6_K)
//   kHasMin, kZero        the offset: a float one per block or half (kHasMin: weight = ws * operand + wo), or the
//                         operand's fixed zero (weight = ws * (operand - kZero), so wo = -kZero * ws)
//   decode(src, codes, head, per32)
//                         one file block into its codes (element order) and raw fields
//   scales(head, per32, ws, wo)
//                         the fields as floats (or 16 rows of them in AVX-512 vectors) -> each 32-element block's
//                         (or half's) scale ws and offset wo: weight = ws * operand(code) + wo, exact in fp32
// Everything else (the packed layout, the kernels, row lookups) is derived from these.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

namespace pagedllm {

// ggml type ids (the GGUF file's).
enum QType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13,
  kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23, kMXFP4 = 39
};

// How a code is stored in the packed form, and what the int8 dot's unsigned operand is.
enum class Codes {
  k2,    // 2 bits (operand = code)
  k3,    // 2 bits + a third bit in a separate bit plane (operand = code)
  k4,    // 4 bits (operand = code)
  k5,    // 4 bits + a fifth bit in a separate bit plane
  k6,    // 4 bits + two bits in a separate plane
  k8,    // a byte
  kNL4,  // a 4-bit index into kNonLinear4 (operand = kNonLinear4[code] + 128)
  kMX4,  // a 4-bit index into kE2M1x2 (operand = kE2M1x2[code] + 12)
};

// kLo4 / kHi4: two 4-bit fields in one byte, the low nibble's field listed first and the high one right after it
// (the high one takes no bytes of its own). kE8M0Half: an e8m0 exponent byte e, read as half its power of two,
// 2^(e - 128) (e8m0_half), the scale of MXFP4's doubled codes.
enum class Field : uint8_t { kF16, kU8, kS8, kLo4, kHi4, kE8M0Half };

constexpr int64_t field_bytes(Field f) { return f == Field::kF16 ? 2 : f == Field::kHi4 ? 0 : 1; }

// The 16 weight values a 4-bit index selects (before the block scale), and the zero the dot's unsigned operand
// is taken from (operand = value + zero). IQ4_NL / IQ4_XS:
constexpr int8_t kNonLinear4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4: the e2m1 values doubled, so that they are integers (the scale is halved to match: Field::kE8M0Half).
// Operands up to 24, below 128: the AVX2 path's unsigned dot takes them as they are.
constexpr int8_t kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

template <Codes C>
constexpr bool kTableCodes = C == Codes::kNL4 || C == Codes::kMX4;
template <Codes C>
constexpr int kTableZero = C == Codes::kNL4 ? 128 : 12;

// The dot's unsigned operand for a stored code.
template <Codes C>
inline int operand(int code) {
  if constexpr (C == Codes::kNL4) return kNonLinear4[code] + kTableZero<C>;
  if constexpr (C == Codes::kMX4) return kE2M1x2[code] + kTableZero<C>;
  return code;
}

// An e8m0 byte e as 2^(e - 128) exactly: a subnormal below e = 2 (ggml's e8m0_to_fp32_half). e = 255 is NaN, which
// the loader refuses (quantization/dequant.py), so it never reaches a kernel.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The fp16 value stored (unaligned) at p.
inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return f16_to_f32(h);
#endif
}

inline uint16_t u16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// Byte-parallel helpers for unpacking at load (eight codes per 64-bit word; the packing loop is most of a warm
// load). Little-endian: byte i of a word is element i.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the GGUF block helpers assume a little-endian CPU");
constexpr uint64_t kLowNibbles = 0x0f0f0f0f0f0f0f0full, kByteOnes = 0x0101010101010101ull;

inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline void store_u64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }

// bit i of b -> byte i of the word (0 or 1)
struct SpreadBits {
  uint64_t v[256];
  constexpr SpreadBits() : v() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 8; ++i) v[b] |= static_cast<uint64_t>((b >> i) & 1) << (8 * i);
  }
};
inline constexpr SpreadBits kSpreadBits{};

// the low bit of byte i -> bit i (the multiply moves each to the top byte without carries)
inline uint32_t gather_bits(uint64_t w) { return static_cast<uint32_t>(((w & kByteOnes) * 0x0102040810204080ull) >> 56); }

// 16 bytes: low nibbles to codes[0..16), high nibbles to codes[16..32) (the 32-element layout of Q4_0 and kin).
inline void nibbles32(const uint8_t* qs, uint8_t* codes) {
  for (int i = 0; i < 16; i += 8) {
    const uint64_t q = load_u64(qs + i);
    store_u64(codes + i, q & kLowNibbles), store_u64(codes + i + 16, (q >> 4) & kLowNibbles);
  }
}

// K-quants' 12-byte packing of eight 6-bit scales and mins (ggml's get_scale_min_k4): sub-block j's codes.
inline void k_scale_min_codes(const uint8_t* s, int j, uint8_t* scale, uint8_t* min) {
  if (j < 4) {
    *scale = s[j] & 63, *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K and Q5_K: 64-element chunk c takes 32 quant bytes; low nibbles are sub-block 2c, high nibbles 2c + 1.
inline void k_nibbles(const uint8_t* qs, uint8_t* codes) {
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; l += 8) {
      const uint64_t q = load_u64(qs + 32 * c + l);
      store_u64(codes + 64 * c + l, q & kLowNibbles), store_u64(codes + 64 * c + 32 + l, (q >> 4) & kLowNibbles);
    }
}

template <int64_t T>
struct Traits;

// 32-element blocks with one scale d (fp16, or the field `Scale`): weight = d * (operand - Zero).
template <int Zero, Field Scale = Field::kF16>
struct Scale32 {
  static constexpr int64_t kBlock = 32, kHalves = 1;
  static constexpr bool kHasMin = false;
  static constexpr int kZero = Zero;
  static constexpr Field kHead[] = {Field::kF16};  // unused (kNumHead = 0): an array cannot be empty
  static constexpr int kNumHead = 0;
  static constexpr Field kPer32[] = {Scale};
  template <class V>
  static void scales(const V*, const V* f, V* ws, V* wo) { ws[0] = f[0], wo[0] = f[0] * static_cast<float>(-Zero); }
};

// 32-element blocks with fp16 d and m: weight = d * code + m.
struct ScaleMin32 {
  static constexpr int64_t kBlock = 32, kHalves = 1;
  static constexpr bool kHasMin = true;
  static constexpr int kZero = 0;
  static constexpr Field kHead[] = {Field::kF16};  // unused
  static constexpr int kNumHead = 0;
  static constexpr Field kPer32[] = {Field::kF16, Field::kF16};
  template <class V>
  static void scales(const V*, const V* f, V* ws, V* wo) { ws[0] = f[0], wo[0] = f[1]; }
};

// Q5_0 / Q5_1: the fifth bits of the 32 elements in a little-endian u32 before the nibbles.
inline void q5_codes(const uint8_t* qh, const uint8_t* qs, uint8_t* codes) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  nibbles32(qs, codes);
  for (int i = 0; i < 32; i += 8) store_u64(codes + i, load_u64(codes + i) | kSpreadBits.v[(h >> i) & 255] << 4);
}

template <>
struct Traits<kQ4_0> : Scale32<8> {
  static constexpr int64_t kBytes = 18;
  static constexpr Codes kCodes = Codes::k4;
  static void decode(const uint8_t* b, uint8_t* codes, uint16_t*, uint16_t* per32) {
    per32[0] = u16_at(b);
    nibbles32(b + 2, codes);
  }
};

template <>
struct Traits<kQ4_1> : ScaleMin32 {
  static constexpr int64_t kBytes = 20;
  static constexpr Codes kCodes = Codes::k4;
  static void decode(const uint8_t* b, uint8_t* codes, uint16_t*, uint16_t* per32) {
    per32[0] = u16_at(b), per32[1] = u16_at(b + 2);
    nibbles32(b + 4, codes);
  }
};

template <>
struct Traits<kQ5_0> : Scale32<16> {
  static constexpr int64_t kBytes = 22;
  static constexpr Codes kCodes = Codes::k5;
  static void decode(const uint8_t* b, uint8_t* codes, uint16_t*, uint16_t* per32) {
    per32[0] = u16_at(b);
    q5_codes(b + 2, b + 6, codes);
  }
};

template <>
struct Traits<kQ5_1> : ScaleMin32 {
  static constexpr int64_t kBytes = 24;
  static constexpr Codes kCodes = Codes::k5;
  static void decode(const uint8_t* b, uint8_t* codes, uint16_t*, uint16_t* per32) {
    per32[0] = u16_at(b), per32[1] = u16_at(b + 2);
    q5_codes(b + 4, b + 8, codes);
  }
};

template <>
struct Traits<kQ8_0> : Scale32<128> {
  static constexpr int64_t kBytes = 34;
  static constexpr Codes kCodes = Codes::k8;
  static void decode(const uint8_t* b, uint8_t* codes, uint16_t*, uint16_t* per32) {
    per32[0] = u16_at(b);
    for (int i = 0; i < 32; ++i) codes[i] = b[2 + i] ^ 0x80;  // s8 -> u8 + 128
  }
};

// IQ4_NL and MXFP4: a scale field, then 16 bytes of 4-bit indices into the codes' table (Q4_0's nibble order).
template <Codes C, Field Scale>
struct Table4 : Scale32<kTableZero<C>, Scale> {
  static constexpr int64_t kScaleBytes = field_bytes(Scale), kBytes = kScaleBytes + 16;
  static constexpr Codes kCodes = C;
  static void decode(const uint8_t* b, uint8_t* codes, uint16_t*, uint16_t* per32) {
    per32[0] = kScaleBytes == 2 ? u16_at(b) : b[0];
    nibbles32(b + kScaleBytes, codes);
  }
};

template <>
struct Traits<kIQ4_NL> : Table4<Codes::kNL4, Field::kF16> {};

template <>
struct Traits<kMXFP4> : Table4<Codes::kMX4, Field::kE8M0Half> {};

// Q4_K / Q5_K: d, dmin per 256; a 6-bit scale and min per 32 (weight = d * scale * q - dmin * min).
struct KScaleMin {
  static constexpr int64_t kBlock = 256, kHalves = 1;
  static constexpr bool kHasMin = true;
  static constexpr int kZero = 0;
  static constexpr Field kHead[] = {Field::kF16, Field::kF16};  // d, dmin
  static constexpr int kNumHead = 2;
  static constexpr Field kPer32[] = {Field::kU8, Field::kU8};  // scale, min
  static void fields(const uint8_t* b, uint16_t* head, uint16_t* per32) {
    head[0] = u16_at(b), head[1] = u16_at(b + 2);
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, mn;
      k_scale_min_codes(b + 4, j, &sc, &mn);
      per32[2 * j] = sc, per32[2 * j + 1] = mn;
    }
  }
  template <class V>
  static void scales(const V* h, const V* f, V* ws, V* wo) { ws[0] = h[0] * f[0], wo[0] = -(h[1] * f[1]); }
};

template <>
struct Traits<kQ4_K> : KScaleMin {
  static constexpr int64_t kBytes = 144;
  static constexpr Codes kCodes = Codes::k4;
  static void decode(const uint8_t* b, uint8_t* codes, uint16_t* head, uint16_t* per32) {
    fields(b, head, per32);
    k_nibbles(b + 16, codes);
  }
};

template <>
struct Traits<kQ5_K> : KScaleMin {
  static constexpr int64_t kBytes = 176;
  static constexpr Codes kCodes = Codes::k5;
  static void decode(const uint8_t* b, uint8_t* codes, uint16_t* head, uint16_t* per32) {
    fields(b, head, per32);
    k_nibbles(b + 48, codes);
    const uint8_t* qh = b + 16;  // bit 2c of qh[l]: element l of sub-block 2c; bit 2c + 1: of sub-block 2c + 1
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; l += 8)
        store_u64(codes + 32 * j + l, load_u64(codes + 32 * j + l) | ((load_u64(qh + l) >> j) & kByteOnes) << 4);
  }
};

// 256-element blocks with fp16 d and a signed 8-bit scale per 16 elements: weight = d * scale_16 * (operand - Zero).
template <int Zero>
struct KScale16 {
  static constexpr int64_t kBlock = 256, kHalves = 2;
  static constexpr bool kHasMin = false;
  static constexpr int kZero = Zero;
  static constexpr Field kHead[] = {Field::kF16};  // d
  static constexpr int kNumHead = 1;
  static constexpr Field kPer32[] = {Field::kS8, Field::kS8};  // the scales of elements 0..15, 16..31
  template <class V>
  static void scales(const V* h, const V* f, V* ws, V* wo) {
    ws[0] = h[0] * f[0], ws[1] = h[0] * f[1];
    wo[0] = ws[0] * static_cast<float>(-kZero), wo[1] = ws[1] * static_cast<float>(-kZero);
  }
};

// Q2_K and Q3_K: the low two bits of each code, in halves of 128: element 32 s + l of half h is bits 2s, 2s + 1 of
// qs[32 h + l].
inline void k_bit_pairs(const uint8_t* qs, uint8_t* codes) {
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int l = 0; l < 32; l += 8)
        store_u64(codes + 128 * h + 32 * s + l, (load_u64(qs + 32 * h + l) >> (2 * s)) & 3 * kByteOnes);
}

// Q2_K: 2-bit codes (weight = d * scale_16 * q - dmin * min_16): a byte per 16 elements (scale, min << 4), the
// codes, then d and dmin.
template <>
struct Traits<kQ2_K> {
  static constexpr int64_t kBlock = 256, kBytes = 84, kHalves = 2;
  static constexpr bool kHasMin = true;
  static constexpr int kZero = 0;
  static constexpr Codes kCodes = Codes::k2;
  static constexpr Field kHead[] = {Field::kF16, Field::kF16};  // d, dmin
  static constexpr int kNumHead = 2;
  // the scale and min of elements 0..15, then of 16..31: the file's two bytes
  static constexpr Field kPer32[] = {Field::kLo4, Field::kHi4, Field::kLo4, Field::kHi4};
  static void decode(const uint8_t* b, uint8_t* codes, uint16_t* head, uint16_t* per32) {
    head[0] = u16_at(b + 80), head[1] = u16_at(b + 82);
    for (int j = 0; j < 16; ++j) per32[2 * j] = b[j] & 15, per32[2 * j + 1] = b[j] >> 4;
    k_bit_pairs(b + 16, codes);
  }
  template <class V>
  static void scales(const V* h, const V* f, V* ws, V* wo) {
    ws[0] = h[0] * f[0], wo[0] = -(h[1] * f[1]), ws[1] = h[0] * f[2], wo[1] = -(h[1] * f[3]);
  }
};

// Q3_K: 3-bit codes (weight = d * (scale_16 - 32) * (q - 4)): a bit mask of the third bits, the low two bits, 16
// 6-bit scales in 12 bytes, d last. ggml stores q - 4 with the third bit set meaning +0, so code = low | bit << 2.
template <>
struct Traits<kQ3_K> : KScale16<4> {
  static constexpr int64_t kBytes = 110;
  static constexpr Codes kCodes = Codes::k3;
  static void decode(const uint8_t* b, uint8_t* codes, uint16_t* head, uint16_t* per32) {
    const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    head[0] = u16_at(b + 108);
    for (int j = 0; j < 16; ++j) {  // low nibbles: bytes 0..7, then their high nibbles; top two bits: bytes 8..11
      const int low = j < 8 ? sc[j] & 15 : sc[j - 8] >> 4, high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
      per32[j] = static_cast<uint8_t>(static_cast<int8_t>((low | high << 4) - 32));
    }
    k_bit_pairs(qs, codes);  // then the third bit: element 32 s + l of half h has bit 4h + s of hmask[l]
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        for (int l = 0; l < 32; l += 8) {
          uint8_t* c = codes + 128 * h + 32 * s + l;
          store_u64(c, load_u64(c) | ((load_u64(hmask + l) >> (4 * h + s)) & kByteOnes) << 2);
        }
  }
};

// Q6_K: 6-bit codes (weight = d * scale_16 * (q - 32)), an int8 scale per 16 elements, d last.
template <>
struct Traits<kQ6_K> : KScale16<32> {
  static constexpr int64_t kBytes = 210;
  static constexpr Codes kCodes = Codes::k6;
  static void decode(const uint8_t* b, uint8_t* codes, uint16_t* head, uint16_t* per32) {
    head[0] = u16_at(b + 208);
    for (int j = 0; j < 16; ++j) per32[j] = b[192 + j];
    for (int h = 0; h < 2; ++h) {  // halves of 128: element l, l + 32, l + 64, l + 96 (l < 32)
      const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
      uint8_t* q = codes + 128 * h;
      for (int l = 0; l < 32; ++l) {
        q[l] = (ql[l] & 15) | ((qh[l] & 3) << 4);
        q[l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
        q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
    }
  }
};

// IQ4_XS: d per 256, a 6-bit scale (minus 32) per 32, 4-bit indices into kNonLinear4.
template <>
struct Traits<kIQ4_XS> {
  static constexpr int64_t kBlock = 256, kBytes = 136, kHalves = 1;
  static constexpr bool kHasMin = false;
  static constexpr int kZero = kTableZero<Codes::kNL4>;
  static constexpr Codes kCodes = Codes::kNL4;
  static constexpr Field kHead[] = {Field::kF16};  // d
  static constexpr int kNumHead = 1;
  static constexpr Field kPer32[] = {Field::kS8};  // scale - 32
  static void decode(const uint8_t* b, uint8_t* codes, uint16_t* head, uint16_t* per32) {
    head[0] = u16_at(b);
    const uint16_t high = u16_at(b + 2);
    for (int j = 0; j < 8; ++j) {
      const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4);
      per32[j] = static_cast<uint8_t>(static_cast<int8_t>(ls - 32));
      nibbles32(b + 8 + 16 * j, codes + 32 * j);
    }
  }
  template <class V>
  static void scales(const V* h, const V* f, V* ws, V* wo) { ws[0] = h[0] * f[0], wo[0] = ws[0] * static_cast<float>(-kZero); }
};

// Every type the kernels read, in one list: adding a type is its Traits and one entry here (and its Python row).
template <int64_t... Ts>
struct TypeList {};
using QuantTypes = TypeList<kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K, kIQ4_NL,
                            kIQ4_XS, kMXFP4>;

template <int64_t T>
struct TypeTag {
  static constexpr int64_t value = T;
  using traits = Traits<T>;
};

// Calls f(TypeTag<T>{}) for the type whose id is `qtype`; returns false where no listed type has that id.
template <class F, int64_t... Ts>
bool visit_type_in(TypeList<Ts...>, int64_t qtype, F&& f) {
  return ((qtype == Ts ? (f(TypeTag<Ts>{}), true) : false) || ...);
}

template <class F>
bool visit_type(int64_t qtype, F&& f) {
  return visit_type_in(QuantTypes{}, qtype, static_cast<F&&>(f));
}

template <class F, int64_t... Ts>
void for_each_type_in(TypeList<Ts...>, F&& f) {
  (f(TypeTag<Ts>{}), ...);
}

template <class F>
void for_each_type(F&& f) {
  for_each_type_in(QuantTypes{}, static_cast<F&&>(f));
}

}  // namespace pagedllm
