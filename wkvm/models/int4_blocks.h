// The int4 kernel's block code (int4_linear.cpp describes the format and the paths), shared by the `wkvm_int4`
// ops and the fused Llama layer (fused.cpp), which runs a decode step's matmuls on its own threads' shares: the
// same code, so the same bits. Its users build it without floating-point contraction (int4_linear.cpp with
// -ffp-contract=off, fused.cpp around its #include).
// int8.load_kernel hashes the headers a source includes with quotes: editing this file rebuilds its users.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "x_groups.h"

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(WKVM_X86)
#include <immintrin.h>
#define WKVM_X86 1
#endif

namespace wkvm::int4 {
namespace {  // internal linkage: each library that includes this keeps its own copy


constexpr int64_t GROUP = 32;       // weights per scale, along K
constexpr int64_t ROWS = 16;        // rows per block
constexpr int64_t ROW_BYTES = 20;   // per row and group: 16 nibble bytes, fp16 d, fp16 m
constexpr int64_t BLOCK_BYTES = ROWS * ROW_BYTES;  // per block and group
constexpr int64_t NIBBLES = 256;    // a block group's nibble bytes, before its 16 d and 16 m

struct Problem {
  const int8_t* xq;   // [M, K] x rounded to int8 per group
  const float* xs;    // [M, G] the groups' scales
  const float* xsd;   // [M, G] the groups' sums of xq times their scales
  const uint8_t* w;   // [N, G * 20]
  float* y;           // [M, N]
  int64_t M, N, K, G, blocks;
};

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v;
  if (exp == 0) {
    v = static_cast<float>(man) * 5.9604644775390625e-8f;  // subnormal: man * 2^-24, exact
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    bits |= sign;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline const uint8_t* block_group(const Problem& p, int64_t b, int64_t g) {
  return p.w + b * ROWS * p.G * ROW_BYTES + g * BLOCK_BYTES;
}

// From 4 rows x, a block's first pass asks the next block's group into L2 (prefetcht1) with each of its own groups:
// the arithmetic then overlaps the next weights' way from memory. Op from memory, paired (AMD EPYC, 2 threads,
// SmolLM2 shapes K = 576): VNNI 8 rows 1.02-1.19x, 16 rows 1.13-1.29x, 4-6 rows 0.95-1.08x; AVX2 4 and 8 rows
// 0.98-1.29x. Not below 4 rows on the AVX-512 paths, as in the int8 kernel, where a one-row call ran 0.85-1.05x with
// it; AVX2's one-row pass does (half_avx2).
constexpr int64_t PREFETCH_ROWS = 4;
inline void prefetch_group(const uint8_t* g) {
  for (int64_t o = 0; o < BLOCK_BYTES; o += 64) __builtin_prefetch(g + o, 0, 2);
}

// acc plus one group's contribution dx * (d * isum + m * sum(xq)) = isum * (d * dx) + m * xsd, as two fused
// multiply-adds: the same operations in the same order on every path (std::fma rounds once, like the vector FMAs)
inline float group_term(float acc, int32_t isum, float d, float m, float dx, float xsd) {
  return std::fma(m, xsd, std::fma(static_cast<float>(isum), d * dx, acc));
}

// ---- portable C++ (the reference the vector paths equal bit for bit) ----

// weight k of row r in a block group, and of a plain row's group
inline int32_t block_q(const uint8_t* bg, int64_t r, int64_t k) {
  const uint8_t byte = bg[64 * (k / 8) + 4 * r + (k % 4)];
  return (k % 8) < 4 ? byte & 15 : byte >> 4;
}

inline int32_t plain_q(const uint8_t* pg, int64_t k) { return k < 16 ? pg[k] & 15 : pg[k - 16] >> 4; }

void blocks_scalar(const Problem& p, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t r = 0; r < ROWS; ++r) {
        float acc = 0.f;
        for (int64_t g = 0; g < p.G; ++g) {
          const uint8_t* bg = block_group(p, b, g);
          const int8_t* xg = p.xq + m * p.K + g * GROUP;
          int32_t isum = 0;
          for (int64_t k = 0; k < GROUP; ++k) isum += block_q(bg, r, k) * xg[k];
          const float d = half_to_float(load_u16(bg + NIBBLES + 2 * r));
          const float mn = half_to_float(load_u16(bg + NIBBLES + 32 + 2 * r));
          acc = group_term(acc, isum, d, mn, p.xs[m * p.G + g], p.xsd[m * p.G + g]);
        }
        p.y[m * p.N + b * ROWS + r] = acc;
      }
}

void rows_scalar(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < p.M; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < p.G; ++g) {
        const uint8_t* pg = p.w + n * p.G * ROW_BYTES + g * ROW_BYTES;
        const int8_t* xg = p.xq + m * p.K + g * GROUP;
        int32_t isum = 0;
        for (int64_t k = 0; k < GROUP; ++k) isum += plain_q(pg, k) * xg[k];
        const float d = half_to_float(load_u16(pg + 16)), mn = half_to_float(load_u16(pg + 18));
        acc = group_term(acc, isum, d, mn, p.xs[m * p.G + g], p.xsd[m * p.G + g]);
      }
      p.y[m * p.N + n] = acc;
    }
}

#ifdef WKVM_X86

// ---- AVX2: 8 rows of a block per register ----

#define WKVM_I4_AVX2 "avx2,f16c,fma"

// x's quad at x (4 int8) in every lane
__attribute__((target(WKVM_I4_AVX2))) inline __m256i quad_avx2(const int8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, sizeof quad);
  return _mm256_set1_epi32(quad);
}

// 8 rows' float sums plus one group's term from their int16 pair sums s16: group_term's two fused multiply-adds, in
// its order (every AVX2 pass adds a group through here, so the passes give the same bits)
__attribute__((target(WKVM_I4_AVX2))) inline __m256 add_term_avx2(__m256 acc, __m256i s16, __m256 d, __m256 mn,
                                                                  __m256 dx, __m256 xsd) {
  const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
  return _mm256_fmadd_ps(mn, xsd, _mm256_fmadd_ps(isum, _mm256_mul_ps(d, dx), acc));
}

// one row of x against half h of block b (its rows 8h..8h+7); `next`: ask block b + 1 into L2 meanwhile (the first
// half's pass). A decode step's one row reads weights from memory: SmolLM2 int4 one-stream steps 0.86-1.32x with it
// (18 alternating process pairs, median ~1.09x), RWKV-7 0.1B int4 one stream 0.99-1.11x (3 pairs); a C harness,
// one thread, 70 MB of weights 1.01-1.14x, but a matrix already in L2 0.86x (session 55)
__attribute__((target(WKVM_I4_AVX2))) void half_avx2(const Problem& p, int64_t b, int64_t h, int64_t m, bool next) {
  const __m256i low = _mm256_set1_epi8(15);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.G; ++g) {
    const uint8_t* bg = block_group(p, b, g);
    if (next) prefetch_group(block_group(p, b + 1, g));
    __m256i wv[8];
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bg + 64 * c + 32 * h));
      wv[2 * c] = _mm256_and_si256(raw, low);
      wv[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bg + NIBBLES + 16 * h)));
    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bg + NIBBLES + 32 + 16 * h)));
    const int8_t* xg = p.xq + m * p.K + g * GROUP;
    // each int16 lane adds the group's 8 pair sums, each at most 2 * 15 * 127 = 3,810 in magnitude (x is rounded
    // to -127..127): 30,480 at most, so no lane saturates or wraps, and one vpmaddwd widens them. Against widening
    // each pair sum (a vpmaddwd and a vpaddd a step): 17 instructions a group instead of 24. AMD EPYC Zen 3, one
    // thread, weights in cache, best of 9: 1.09-1.16x at 1-16 rows; SmolLM2 int4 8 batched through the engine
    // within the noise (0.96x, median of 10 alternating runs; session 52)
    __m256i s16 = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wv[j], quad_avx2(xg + 4 * j)));
    const int64_t gi = m * p.G + g;
    acc = add_term_avx2(acc, s16, d, mn, _mm256_set1_ps(p.xs[gi]), _mm256_set1_ps(p.xsd[gi]));
  }
  _mm256_storeu_ps(p.y + m * p.N + b * ROWS + 8 * h, acc);
}

// From two rows of x, a block's group is unpacked once, its 16 rows' nibbles as bytes in an L1 buffer, and every row
// of x takes both halves from there, two rows at a time (each weight vector loaded feeds four vpmaddubsw, each
// broadcast quad of x two); the rows' float sums wait in a stack buffer between groups. The integer sums and the
// float operations per group and row are those of half_avx2, so the bits are. AMD EPYC Zen 3, one thread, a C harness
// over SmolLM2-shaped block matrices against half_avx2 in fours, outputs compared bytewise: -march=native (as
// fused.cpp) 1.1-1.4x at 3-100 rows; target attributes only (as int4_linear.cpp) 0.95-1.24x at 3-5 rows, 1.36-1.78x
// at 16-100; 0.8-1.15x at 2 (noise); one row keeps half_avx2. Without the asm statements pinning the int16 sums
// GCC's generic build reordered the products through the stack and ran 0.80-0.97x at 8 rows (session 55).
constexpr int64_t AVX2_X_ROWS = 32;  // rows of x whose sums one pass over a block's groups holds

// a row of x's group sums s0 (block rows 0-7) and s1 (8-15) added into its 16 float sums at acc
__attribute__((target(WKVM_I4_AVX2))) inline void add_group_avx2(const Problem& p, int64_t m, int64_t g, __m256i s0,
                                                                 __m256i s1, __m256 d0, __m256 d1, __m256 mn0,
                                                                 __m256 mn1, float* acc) {
  const int64_t gi = m * p.G + g;
  const __m256 dx = _mm256_set1_ps(p.xs[gi]), xsd = _mm256_set1_ps(p.xsd[gi]);
  _mm256_store_ps(acc, add_term_avx2(_mm256_load_ps(acc), s0, d0, mn0, dx, xsd));
  _mm256_store_ps(acc + 8, add_term_avx2(_mm256_load_ps(acc + 8), s1, d1, mn1, dx, xsd));
}

// rows m0 .. m0 + rows of x (at most AVX2_X_ROWS) against block b
__attribute__((target(WKVM_I4_AVX2))) void block_avx2(const Problem& p, int64_t b, int64_t m0, int64_t rows,
                                                      bool next) {
  const __m256i low = _mm256_set1_epi8(15);
  alignas(32) uint8_t w[ROWS * GROUP];  // the group's k 4j..4j+3 of rows 0-7 at 32 j, of rows 8-15 at 32 (8 + j)
  alignas(32) float acc[AVX2_X_ROWS * ROWS];
  std::fill(acc, acc + rows * ROWS, 0.0f);
  for (int64_t g = 0; g < p.G; ++g) {
    const uint8_t* bg = block_group(p, b, g);
    if (next) prefetch_group(block_group(p, b + 1, g));
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 4; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bg + 64 * c + 32 * h));
        uint8_t* wc = w + 32 * (8 * h + 2 * c);
        _mm256_store_si256(reinterpret_cast<__m256i*>(wc), _mm256_and_si256(raw, low));
        _mm256_store_si256(reinterpret_cast<__m256i*>(wc + 32), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low));
      }
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bg + NIBBLES)));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bg + NIBBLES + 16)));
    const __m256 mn0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bg + NIBBLES + 32)));
    const __m256 mn1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bg + NIBBLES + 48)));
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {  // two rows of x: each weight vector loaded feeds four vpmaddubsw
      const int8_t* xa = p.xq + (m0 + r) * p.K + g * GROUP;
      const int8_t* xb = xa + p.K;
      __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
      __m256i b0 = _mm256_setzero_si256(), b1 = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i va = quad_avx2(xa + 4 * j), vb = quad_avx2(xb + 4 * j);
        const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
        const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32 * (8 + j)));
        a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(w0, va));
        a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(w1, va));
        b0 = _mm256_add_epi16(b0, _mm256_maddubs_epi16(w0, vb));
        b1 = _mm256_add_epi16(b1, _mm256_maddubs_epi16(w1, vb));
        asm("" : "+x"(a0), "+x"(a1), "+x"(b0), "+x"(b1));  // the four sums stay in registers, step by step
      }
      add_group_avx2(p, m0 + r, g, a0, a1, d0, d1, mn0, mn1, acc + ROWS * r);
      add_group_avx2(p, m0 + r + 1, g, b0, b1, d0, d1, mn0, mn1, acc + ROWS * (r + 1));
    }
    if (r < rows) {
      const int8_t* xa = p.xq + (m0 + r) * p.K + g * GROUP;
      __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i va = quad_avx2(xa + 4 * j);
        const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
        const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + 32 * (8 + j)));
        a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(w0, va));
        a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(w1, va));
        asm("" : "+x"(a0), "+x"(a1));
      }
      add_group_avx2(p, m0 + r, g, a0, a1, d0, d1, mn0, mn1, acc + ROWS * r);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(p.y + (m0 + r) * p.N + b * ROWS, acc + ROWS * r, sizeof(float) * ROWS);
}

__attribute__((target(WKVM_I4_AVX2))) void blocks_avx2(const Problem& p, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    if (p.M == 1) {
      for (int64_t h = 0; h < 2; ++h) half_avx2(p, b, h, 0, h == 0 && b + 1 < b1);
      continue;
    }
    for (int64_t m0 = 0; m0 < p.M; m0 += AVX2_X_ROWS)
      block_avx2(p, b, m0, std::min(AVX2_X_ROWS, p.M - m0), m0 == 0 && p.M >= PREFETCH_ROWS && b + 1 < b1);
  }
}

// ---- AVX-512BW and AVX512-VNNI: 16 rows per register ----

#define WKVM_I4_AVX512 "avx2,f16c,avx512f,avx512bw"
#define WKVM_I4_VNNI "avx2,f16c,avx512f,avx512bw,avx512vnni"

#define WKVM_KERNELS512(NAME, TARGET, DOT, WIDEN)                                                              \
  template <int MT>                                                                                            \
  __attribute__((target(TARGET))) void NAME##_block(const Problem& p, int64_t b, int64_t m, bool next) {       \
    const __m512i low = _mm512_set1_epi8(15);                                                                  \
    __m512 acc[MT];                                                                                            \
    for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();                                                 \
    for (int64_t g = 0; g < p.G; ++g) {                                                                        \
      const uint8_t* bg = block_group(p, b, g);                                                                \
      if (next) prefetch_group(block_group(p, b + 1, g));                                                      \
      __m512i wv[8];                                                                                           \
      for (int c = 0; c < 4; ++c) {                                                                            \
        const __m512i raw = _mm512_loadu_si512(bg + 64 * c);                                                   \
        wv[2 * c] = _mm512_and_si512(raw, low);                                                                \
        wv[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);                                      \
      }                                                                                                        \
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bg + NIBBLES)));    \
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bg + NIBBLES + 32))); \
      __m512i isums[MT];                                                                                       \
      for (int i = 0; i < MT; ++i) isums[i] = _mm512_setzero_si512();                                          \
      for (int j = 0; j < 8; ++j) {                                                                            \
        for (int i = 0; i < MT; ++i) {                                                                         \
          int32_t quad;                                                                                        \
          std::memcpy(&quad, p.xq + (m + i) * p.K + g * GROUP + 4 * j, sizeof quad);                           \
          isums[i] = DOT(isums[i], wv[j], _mm512_set1_epi32(quad));                                            \
        }                                                                                                      \
      }                                                                                                        \
      for (int i = 0; i < MT; ++i) {                                                                           \
        const __m512i isum = WIDEN(isums[i]);                                                                  \
        const int64_t gi = (m + i) * p.G + g;                                                                  \
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(p.xs[gi])),  \
                                         acc[i]);                                                              \
        acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(p.xsd[gi]), t);                                            \
      }                                                                                                        \
    }                                                                                                          \
    for (int i = 0; i < MT; ++i) _mm512_storeu_ps(p.y + (m + i) * p.N + b * ROWS, acc[i]);                     \
  }                                                                                                            \
  __attribute__((target(TARGET))) void NAME##_blocks(const Problem& p, int64_t b0, int64_t b1) {               \
    for (int64_t b = b0; b < b1; ++b) {                                                                        \
      int64_t m = 0;                                                                                           \
      const bool next = p.M >= PREFETCH_ROWS && b + 1 < b1;                                                    \
      for (; m + 8 <= p.M; m += 8) NAME##_block<8>(p, b, m, next && m == 0);                                   \
      for (; m + 4 <= p.M; m += 4) NAME##_block<4>(p, b, m, next && m == 0);                                   \
      for (; m + 2 <= p.M; m += 2) NAME##_block<2>(p, b, m, false);                                            \
      for (; m < p.M; ++m) NAME##_block<1>(p, b, m, false);                                                    \
    }                                                                                                          \
  }

// AVX-512BW: a group's 8 vpmaddubsw pair sums added in int16 (each lane at most 8 * 2 * 15 * 127 = 30,480 in magnitude:
// no lane saturates or wraps, as on the AVX2 path) and widened by one vpmaddwd, instead of a vpmaddwd and a vpaddd
// each: the same integer sums, so the same bits. Measured on an AMD EPYC Zen 4 with the path forced (one thread, a C
// harness with both versions in one process, median of 7, outputs bytewise equal to the old loop's and the scalar
// reference's, weights at 15 and x at +-127 too; session 58): 1 row 1.13x, 2 rows 1.20x, 4-256 rows 1.35-1.44x on
// SmolLM2's shapes and its 49,152-row head; SmolLM2 int4 8 batched through the engine on this path (two threads,
// alternating processes, those whose probe put the threads on cores of their own) 1,116-1,204 against 911-1,013
// tok/s. (The VNNI path is this macro's other use, unchanged.)
#define WKVM_DOT_BW(acc, w, x) _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x))
#define WKVM_WIDEN_BW(s16) _mm512_madd_epi16(s16, _mm512_set1_epi16(1))
#define WKVM_DOT_VNNI(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define WKVM_WIDEN_VNNI(isum) (isum)
WKVM_KERNELS512(avx512, WKVM_I4_AVX512, WKVM_DOT_BW, WKVM_WIDEN_BW)
WKVM_KERNELS512(vnni, WKVM_I4_VNNI, WKVM_DOT_VNNI, WKVM_WIDEN_VNNI)

#ifdef WKVM_AMX

// ---- AMX-INT8: a group of 32 k as tiles, 16 rows of x by a block's 16 rows per tdpbsud ----
// A block group's nibbles, masked and shifted as on the VNNI path, are already quads (row r's k..k+3 in lane r): eight
// of them are a B tile. x's rows are the A tile; tdpbsud multiplies signed x by unsigned weights exactly, so each
// group's int32 sums are VNNI's, and they are added in by the same two fused multiply-adds: the same bits. As in
// int8_blocks.h, fewer than 32 rows of x go to the VNNI loop (each group's sums leave the tiles through memory).

#define WKVM_I4_AMX "avx2,f16c,avx512f,avx512bw,avx512vnni,amx-tile,amx-int8"

using amx::AMX_ROWS;
using amx::TILE_ROWS;

// two sets, one multiplying while the other's sums are added in: tiles 0 (5) a group's sums, 2 (7) its x, 3 (4) its
// weights
inline amx::TileConfig amx_config() {
  amx::TileConfig c;
  for (int t : {0, 5}) c.set(t, TILE_ROWS, 64);
  for (int t : {2, 7}) c.set(t, TILE_ROWS, GROUP);
  for (int t : {3, 4}) c.set(t, GROUP / 4, 64);
  return c;
}

// block b's groups as B tiles, group g's at out + 512 g: a 64-byte chunk c's low nibbles are the quads of k 8c..8c+3,
// its high ones those of 8c+4..8c+7
__attribute__((target(WKVM_I4_AMX))) inline void unpack_amx(const Problem& p, int64_t b, bool next, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t g = 0; g < p.G; ++g) {
    const uint8_t* bg = block_group(p, b, g);
    if (next) prefetch_group(block_group(p, b + 1, g));
    for (int c = 0; c < 4; ++c) {
      const __m512i raw = _mm512_loadu_si512(bg + 64 * c);
      _mm512_store_si512(out + 512 * g + 128 * c, _mm512_and_si512(raw, low));
      _mm512_store_si512(out + 512 * g + 128 * c + 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
    }
  }
}

// one group's product on tile set (S sums, X x, W weights), its sums stored to out; a macro: tile numbers are
// immediates
#define WKVM_I4_TILE_GROUP(S, X, W, xg, stride, wg, out) \
  do {                                                   \
    _tile_zero(S);                                       \
    _tile_loadd(X, xg, stride);                          \
    _tile_loadd(W, wg, 64);                              \
    _tile_dpbsud(S, X, W);                               \
    _tile_stored(S, out, 64);                            \
  } while (0)

// rows m .. m + rows of x (at x, K bytes apart, the tile's rows readable) against block b unpacked at `packed`
__attribute__((target(WKVM_I4_AMX))) inline void tile_rows_amx(const Problem& p, int64_t b, int64_t m, int64_t rows,
                                                            const int8_t* x, const uint8_t* packed) {
  alignas(64) int32_t sums[2][TILE_ROWS][16];
  __m512 acc[TILE_ROWS];
  for (int64_t i = 0; i < rows; ++i) acc[i] = _mm512_setzero_ps();
  const auto multiply = [&](int64_t g) {
    if (g % 2 == 0)
      WKVM_I4_TILE_GROUP(0, 2, 3, x + g * GROUP, p.K, packed + 512 * g, sums[0]);
    else
      WKVM_I4_TILE_GROUP(5, 7, 4, x + g * GROUP, p.K, packed + 512 * g, sums[1]);
  };
  multiply(0);
  for (int64_t g = 0; g < p.G; ++g) {
    if (g + 1 < p.G) multiply(g + 1);
    const uint8_t* bg = block_group(p, b, g);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bg + NIBBLES)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bg + NIBBLES + 32)));
    for (int64_t i = 0; i < rows; ++i) {  // the VNNI loop's two multiply-adds
      const int64_t gi = (m + i) * p.G + g;
      const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(sums[g % 2][i]));
      const __m512 t = _mm512_fmadd_ps(isum, _mm512_mul_ps(d, _mm512_set1_ps(p.xs[gi])), acc[i]);
      acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(p.xsd[gi]), t);
    }
  }
  for (int64_t i = 0; i < rows; ++i) _mm512_storeu_ps(p.y + (m + i) * p.N + b * ROWS, acc[i]);
}

#undef WKVM_I4_TILE_GROUP

__attribute__((target(WKVM_I4_AMX))) void amx_blocks(const Problem& p, int64_t b0, int64_t b1) {
  if (p.M < AMX_ROWS) return vnni_blocks(p, b0, b1);
  if (b0 >= b1) return;
  const int64_t whole = p.M / TILE_ROWS * TILE_ROWS, tail = p.M - whole;  // K is 32 groups' multiple: only rows pad
  uint8_t* packed = reinterpret_cast<uint8_t*>(amx::scratch(size_t(512 * p.G + TILE_ROWS * p.K)));
  int8_t* last = reinterpret_cast<int8_t*>(packed + 512 * p.G);  // the short last tile's rows, zeros after them
  if (tail) {
    std::memset(last, 0, size_t(TILE_ROWS * p.K));
    std::memcpy(last, p.xq + whole * p.K, size_t(tail * p.K));
  }
  const amx::TileConfig config = amx_config();
  _tile_loadconfig(&config);
  for (int64_t b = b0; b < b1; ++b) {
    unpack_amx(p, b, b + 1 < b1, packed);
    for (int64_t m = 0; m < p.M; m += TILE_ROWS)
      tile_rows_amx(p, b, m, std::min(TILE_ROWS, p.M - m), m < whole ? p.xq + m * p.K : last, packed);
  }
  _tile_release();
}

#endif  // WKVM_AMX

#endif  // WKVM_X86

int64_t best_isa() {
#ifdef WKVM_X86
  __builtin_cpu_init();
  const bool bw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (bw && __builtin_cpu_supports("avx512vnni")) return amx::usable() ? 4 : 3;
  if (bw) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

using Blocks = void (*)(const Problem&, int64_t, int64_t);

// the block loop of kernel path `isa` (0 portable, 1 AVX2, 2 AVX-512BW, 3 AVX512-VNNI, 4 AMX-INT8)
inline Blocks blocks_of(int64_t isa) {
#ifdef WKVM_X86
  if (isa == 1) return blocks_avx2;
  if (isa == 2) return avx512_blocks;
  if (isa == 3) return vnni_blocks;
#endif
#ifdef WKVM_AMX
  if (isa == 4) return amx_blocks;
#endif
  return blocks_scalar;
}

}  // namespace
}  // namespace wkvm::int4

#undef WKVM_I4_AVX2
#undef WKVM_I4_AVX512
#undef WKVM_I4_VNNI
#undef WKVM_I4_AMX
#undef WKVM_KERNELS512
#undef WKVM_DOT_BW
#undef WKVM_DOT_VNNI
#undef WKVM_WIDEN_BW
#undef WKVM_WIDEN_VNNI
