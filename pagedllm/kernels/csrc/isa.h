// Which instruction sets this build of the extension was compiled for: the one definition every kernel file tests
// (kernels/build.py passes the -m flags of the chosen variant; capabilities.cpp reports these to Python).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PL_AVX512 1  // the fp32 vector paths: attention dot/lanes, the fused fp32 layer, the sampler's vectors
#else
#define PL_AVX512 0
#endif
#if PL_AVX512 && defined(__AVX512BF16__)
#define PL_AVX512_BF16 1  // vdpbf16ps: the bf16 small GEMM, the fused bf16 layer, the bf16 attention paths
#else
#define PL_AVX512_BF16 0
#endif
#if PL_AVX512 && defined(__AVX512VNNI__) && defined(__F16C__)
#define PL_VNNI 1  // vpdpbusd: the quantized GEMMs' int8 dot products and the int8-KV attention path
#else
#define PL_VNNI 0
#endif
#if PL_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PL_AMX 1  // tdpbsud: the packed quantized GEMM's 16 x 16 tiles, where the CPU and the OS allow (amx_usable)
#else
#define PL_AMX 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PL_AVX2 1  // 8-lane fp32 vectors with FMA (every AVX-512 build too): the fused fp32 layer without AVX-512
#else
#define PL_AVX2 0
#endif
#if !PL_VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PL_INT8_AVX2 1  // vpmaddubsw + vpmaddwd: the packed quantized GEMM's int8 dot products without VNNI
#else
#define PL_INT8_AVX2 0
#endif
