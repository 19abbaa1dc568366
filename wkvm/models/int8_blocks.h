// The int8 kernel's block code (int8_linear.cpp describes the format and the paths), shared by the `wkvm_int8`
// ops and the fused Llama layer (fused.cpp), which runs a decode step's matmuls on its own threads' shares: the
// same code, so the same bits. Its users build it without floating-point contraction (int8_linear.cpp with
// -ffp-contract=off, fused.cpp around its #include): every path computes the same float expression.
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
namespace wkvm::int8 {
namespace {  // internal linkage: each library that includes this keeps its own copy


using wkvm::X_GROUP;

constexpr int64_t BLOCK = 32;  // rows per block

struct Problem {
  const int8_t* xq;     // [M, K] x rounded to int8 per group
  const int16_t* x16;   // the same values as int16 (the vpmaddwd paths); null where unused
  const float* xs;      // [M, G] the groups' scales
  const int32_t* xsum;  // [M, G] the groups' sums of xq
  const int8_t* w;      // [N, K + 4]
  float* y;             // [M, N]
  int64_t M, N, K, G, blocks;
};

inline float load_float(const int8_t* p) {
  float s;
  std::memcpy(&s, p, sizeof s);
  return s;
}

inline const int8_t* block_at(const Problem& p, int64_t b) { return p.w + b * BLOCK * (p.K + 4); }

// Group g of block `next` (null: none; the last group with the block's scales) asked into L2 (prefetcht1) while a
// pass over another block computes its group g: by the pass's end the whole next block is on its way
inline void prefetch_share(const Problem& p, const int8_t* next, int64_t g) {
  if (!next) return;
  const int64_t lo = g * BLOCK * X_GROUP, hi = g + 1 == p.G ? BLOCK * (p.K + 4) : lo + BLOCK * X_GROUP;
  for (int64_t o = lo; o < hi; o += 64) __builtin_prefetch(next + o, 0, 2);
}

inline float scale_of(const Problem& p, int64_t n) {
  if (n < p.blocks * BLOCK) return load_float(block_at(p, n / BLOCK) + BLOCK * p.K + 4 * (n % BLOCK));
  return load_float(p.w + n * (p.K + 4) + p.K);
}

// ---- portable C++ (the reference the vector paths must equal bit for bit) ----

// one output: the groups' exact integer sums, each added as one fma, times the row's scale; weight(k) reads W[n, k]
template <class Weight>
inline float output(const Problem& p, int64_t m, int64_t n, const Weight& weight) {
  const int8_t* x = p.xq + m * p.K;
  float acc = 0.f;
  for (int64_t g = 0; g < p.G; ++g) {
    int32_t isum = 0;
    for (int64_t k = g * X_GROUP; k < std::min(p.K, (g + 1) * X_GROUP); ++k) isum += int32_t(x[k]) * weight(k);
    acc = std::fma(static_cast<float>(isum), p.xs[m * p.G + g], acc);
  }
  return acc * scale_of(p, n);
}

void blocks_scalar(const Problem& p, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* w = block_at(p, b);
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t r = 0; r < BLOCK; ++r)
        p.y[m * p.N + b * BLOCK + r] =
            output(p, m, b * BLOCK + r, [&](int64_t k) { return int32_t(w[(k & ~int64_t(1)) * BLOCK + 2 * r + (k & 1)]); });
  }
}

// plain rows (at most 31 after the blocks, or every row of an odd K) on every path
void rows_scalar(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = p.w + n * (p.K + 4);
    for (int64_t m = 0; m < p.M; ++m) p.y[m * p.N + n] = output(p, m, n, [&](int64_t k) { return int32_t(w[k]); });
  }
}

#ifdef WKVM_X86

inline int32_t load_pair(const int16_t* x) {  // x[k], x[k + 1] as one 32-bit value to broadcast
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

// ---- AVX2: a block as four quarters of 8 rows, int16 pairs (vpmaddwd) ----

// s += the pair products of w and x, as two instructions that add into s itself. Written as intrinsics, GCC 12.2 (-O3)
// added each product into a fresh register and moved it back (a vmovdqa each). The same integer sums, so the same
// bits. AMD EPYC Zen 3, AVX2 only (session 57, a noisy host), one thread, a C harness with both versions in one
// process, alternating, outputs compared bytewise: 1.34-1.52x at 2-7 rows in cache (SmolLM2's gate shape), 1.05-1.43x
// on its 49,152-row head from memory at 4 rows, 1.00-1.05x at one row (bound by memory). Through the engine (SmolLM2
// int8 B=4, two threads, alternating processes): 1.02-1.53x (three pairs).
__attribute__((target("avx2"))) inline void madd_into(__m256i& s, __m256i w, __m256i x) {
  __m256i t;
  asm("vpmaddwd %[w], %[x], %[t]\n\tvpaddd %[t], %[s], %[s]" : [s] "+x"(s), [t] "=&x"(t) : [w] "x"(w), [x] "x"(x));
}

// Every row count of x runs this loop, two rows at a time. From 8 rows a "wide" pass (session 52: a group's weights
// widened to int16 once into an L1 buffer, every pair of rows reading them from there) had been faster, but only while
// this loop's sums went through register moves: with both adding in place, this one ran 1.08-1.30x the wide pass at
// 6-512 rows over SmolLM2's and RWKV-7 0.1B's shapes and the 49,152-row head, and 1.00-1.19x at 1,024-4,096 rows
// (harness, one thread, median of 5 rounds, outputs bytewise equal; session 57), so the wide pass was removed.
//
// `next`: a block to ask into L2 meanwhile (prefetch_share)
template <int MT>
__attribute__((target("avx2,fma"))) void block_avx2(const Problem& p, int64_t b, int64_t m, const int8_t* next) {
  const int8_t* w = block_at(p, b);
  __m256 acc[4][MT];
  for (int q = 0; q < 4; ++q)
    for (int i = 0; i < MT; ++i) acc[q][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.G; ++g) {
    __m256i isum[4][MT];
    prefetch_share(p, next, g);
    for (int q = 0; q < 4; ++q)
      for (int i = 0; i < MT; ++i) isum[q][i] = _mm256_setzero_si256();
    for (int64_t k = g * X_GROUP; k < std::min(p.K, (g + 1) * X_GROUP); k += 2) {
      __m256i wv[4];
      for (int q = 0; q < 4; ++q)
        wv[q] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * BLOCK + 16 * q)));
      for (int i = 0; i < MT; ++i) {
        const __m256i xv = _mm256_set1_epi32(load_pair(p.x16 + (m + i) * p.K + k));
        for (int q = 0; q < 4; ++q) madd_into(isum[q][i], wv[q], xv);
      }
    }
    for (int i = 0; i < MT; ++i) {
      const __m256 dx = _mm256_set1_ps(p.xs[(m + i) * p.G + g]);
      for (int q = 0; q < 4; ++q) acc[q][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[q][i]), dx, acc[q][i]);
    }
  }
  const float* scales = reinterpret_cast<const float*>(w + BLOCK * p.K);
  for (int i = 0; i < MT; ++i)
    for (int q = 0; q < 4; ++q)
      _mm256_storeu_ps(p.y + (m + i) * p.N + b * BLOCK + 8 * q, _mm256_mul_ps(acc[q][i], _mm256_loadu_ps(scales + 8 * q)));
}

// From 4 rows (two passes or more over a block) the first pass asks the next block into L2: 1.08-1.33x at 4 and 8
// rows (the RWKV-7 0.1B shapes, K 768 and 3,072, from memory, AMD EPYC restricted to this path), 1.00-1.04x at
// 32. Not below 4 rows (one pass per two rows is too short to hide a block; the VNNI path's one-row call ran
// 0.85-1.05x with it).
__attribute__((target("avx2,fma"))) void blocks_avx2(const Problem& p, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* next = p.M >= 4 && b + 1 < b1 ? block_at(p, b + 1) : nullptr;
    int64_t m = 0;
    for (; m + 2 <= p.M; m += 2) block_avx2<2>(p, b, m, m == 0 ? next : nullptr);
    if (m < p.M) block_avx2<1>(p, b, m, nullptr);
  }
}

// ---- AVX-512BW: two halves of 16 rows, int16 pairs (vpmaddwd) ----

#define WKVM_I8_AVX512 "avx2,fma,avx512f,avx512bw"
#define WKVM_I8_VNNI "avx2,fma,avx512f,avx512bw,avx512vnni"

template <int MT>
__attribute__((target(WKVM_I8_AVX512))) void block_avx512(const Problem& p, int64_t b, int64_t m) {
  const int8_t* w = block_at(p, b);
  __m512 acc[2][MT];
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < MT; ++i) acc[h][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.G; ++g) {
    __m512i isum[2][MT];
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < MT; ++i) isum[h][i] = _mm512_setzero_si512();
    for (int64_t k = g * X_GROUP; k < std::min(p.K, (g + 1) * X_GROUP); k += 2) {
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * BLOCK)));
      const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * BLOCK + 32)));
      for (int i = 0; i < MT; ++i) {
        const __m512i xv = _mm512_set1_epi32(load_pair(p.x16 + (m + i) * p.K + k));
        isum[0][i] = _mm512_add_epi32(isum[0][i], _mm512_madd_epi16(w0, xv));
        isum[1][i] = _mm512_add_epi32(isum[1][i], _mm512_madd_epi16(w1, xv));
      }
    }
    for (int i = 0; i < MT; ++i) {
      const __m512 dx = _mm512_set1_ps(p.xs[(m + i) * p.G + g]);
      for (int h = 0; h < 2; ++h) acc[h][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[h][i]), dx, acc[h][i]);
    }
  }
  const float* scales = reinterpret_cast<const float*>(w + BLOCK * p.K);
  for (int i = 0; i < MT; ++i)
    for (int h = 0; h < 2; ++h)
      _mm512_storeu_ps(p.y + (m + i) * p.N + b * BLOCK + 16 * h, _mm512_mul_ps(acc[h][i], _mm512_loadu_ps(scales + 16 * h)));
}

// ---- AVX512-VNNI: pair rows k and k + 2 interleaved into quads, unsigned weights times int8 x (vpdpbusd) ----
// _mm512_unpack{lo,hi}_epi16 interleave within 128-bit lanes, so lane j of `lo` is row 8 (j / 4) + j % 4 and lane j
// of `hi` is row 8 (j / 4) + 4 + j % 4.

inline int64_t quad_row(int h, int64_t j) { return 8 * (j / 4) + 4 * h + j % 4; }

// row m's outputs of block b from the quads' two halves of sums (lanes as quad_row says) times the rows' scales: rows
// 0-15 are lanes 0-3 of lo, 0-3 of hi, 4-7, 4-7; rows 16-31 the other lanes alike
__attribute__((target(WKVM_I8_VNNI))) inline void store_quads(const Problem& p, int64_t b, int64_t m, __m512 lo,
                                                           __m512 hi) {
  const __m512i rows_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i rows_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const float* s = reinterpret_cast<const float*>(block_at(p, b) + BLOCK * p.K);
  float* y = p.y + m * p.N + b * BLOCK;
  _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_permutex2var_ps(lo, rows_lo, hi), _mm512_loadu_ps(s)));
  _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, rows_hi, hi), _mm512_loadu_ps(s + 16)));
}

// acc += u (unsigned bytes) . s (signed bytes), lane by lane. Written as asm so that GCC keeps each accumulator in one
// register across the loop: with the intrinsic it copied every accumulator in and out of a spare register around
// each vpdpbusd (16 zmm moves per 8 products at 4 rows)
__attribute__((target(WKVM_I8_VNNI))) inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

// isum += quad k..k+3 of 32 rows times rows m..m+MT of x; WHOLE false: only pair row k is left (the quads' top
// halves are zero)
template <int MT, bool WHOLE>
__attribute__((target(WKVM_I8_VNNI))) inline void quad_vnni(const Problem& p, const int8_t* w, int64_t k, int64_t m,
                                                         __m512i (&isum)[2][MT]) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i a = _mm512_loadu_si512(w + k * BLOCK);
  const __m512i c = WHOLE ? _mm512_loadu_si512(w + (k + 2) * BLOCK) : _mm512_setzero_si512();
  const __m512i lo = _mm512_xor_si512(_mm512_unpacklo_epi16(a, c), flip);
  const __m512i hi = _mm512_xor_si512(_mm512_unpackhi_epi16(a, c), flip);
  for (int i = 0; i < MT; ++i) {
    int32_t quad = 0;
    std::memcpy(&quad, p.xq + (m + i) * p.K + k, WHOLE ? 4 : 2);
    const __m512i xv = _mm512_set1_epi32(quad);
    isum[0][i] = dpbusd(isum[0][i], lo, xv);
    isum[1][i] = dpbusd(isum[1][i], hi, xv);
  }
}

// rows m .. m + MT of x against block b (each output's sums go group by group in order: the same bits on every
// path). `next`: a block to ask into L2 meanwhile (prefetch_share)
template <int MT>
__attribute__((target(WKVM_I8_VNNI))) void block_vnni(const Problem& p, int64_t b, int64_t m, const int8_t* next) {
  const int8_t* w = block_at(p, b);
  __m512 acc[2][MT];
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < MT; ++i) acc[h][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.G; ++g) {
    const int64_t k1 = std::min(p.K, (g + 1) * X_GROUP);
    prefetch_share(p, next, g);
    __m512i isum[2][MT];
    for (int i = 0; i < MT; ++i)  // start from minus the flipped weights' extra 128 * sum(xq): the same integers
      isum[0][i] = isum[1][i] = _mm512_set1_epi32(-128 * p.xsum[(m + i) * p.G + g]);
    int64_t k = g * X_GROUP;
    for (; k + 4 <= k1; k += 4) quad_vnni<MT, true>(p, w, k, m, isum);
    if (k < k1) quad_vnni<MT, false>(p, w, k, m, isum);  // K = 2 mod 4: pair row k is the last
    for (int i = 0; i < MT; ++i) {
      const __m512 dx = _mm512_set1_ps(p.xs[(m + i) * p.G + g]);
      for (int h = 0; h < 2; ++h) acc[h][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[h][i]), dx, acc[h][i]);
    }
  }
  for (int i = 0; i < MT; ++i) {
    if constexpr (MT == 1) {  // one row: the scalar stores measured 1.0-1.05x the permutes
      float* y = p.y + (m + i) * p.N + b * BLOCK;
      const int8_t* scales = w + BLOCK * p.K;
      alignas(64) float lanes[BLOCK];
      _mm512_store_ps(lanes, acc[0][i]);
      _mm512_store_ps(lanes + 16, acc[1][i]);
      for (int h = 0; h < 2; ++h)
        for (int64_t j = 0; j < 16; ++j) y[quad_row(h, j)] = lanes[16 * h + j] * load_float(scales + 4 * quad_row(h, j));
    } else {
      store_quads(p, b, m + i, acc[0][i], acc[1][i]);
    }
  }
}

// Eight rows at a time, one pass over each block (16 accumulators: each quad's unpacked weights serve 16 products).
// Paired against two interleaved passes of four rows with the intrinsic and scalar stores (the kernel before, same
// bits; AMD EPYC, AVX512-VNNI): one thread, weights in L2, 1.05-1.39x at 8-32 rows for K = 576 and 768, 1.07-1.19x
// for K = 1,536 and 3,072, 1.06-1.10x at 4 rows; two threads from memory, 8 rows, 1.02-1.35x. The vpdpbusd loop of
// an 8-row block in L1 or L2 alone runs at this CPU's peak (~230 GMAC/s a core); the kernel reaches ~60-77% of it, the
// rest being each group's convert and multiply-add of 16 sums.
// The eight-row pass also asks the next block into L2 (prefetcht1): at 8 and 16 rows 1.02-1.20x and 1.12-1.27x (K =
// 576, from memory); with one pass over blocks of long rows too, two threads from memory, 0.98-1.16x at 8 rows and
// 1.03-1.15x at 16 for 576 x 1,536, 1.10-1.15x and 1.04-1.08x for 768 x 3,072 (three runs). At 1 row the hardware's
// own prefetch keeps up and this was 0.85-1.05x (below 1 for four shapes of five).
__attribute__((target(WKVM_I8_VNNI))) void vnni_blocks(const Problem& p, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    int64_t m = 0;
    for (; m + 8 <= p.M; m += 8) block_vnni<8>(p, b, m, m == 0 && b + 1 < b1 ? block_at(p, b + 1) : nullptr);
    for (; m + 4 <= p.M; m += 4) block_vnni<4>(p, b, m, nullptr);
    for (; m + 2 <= p.M; m += 2) block_vnni<2>(p, b, m, nullptr);
    if (m < p.M) block_vnni<1>(p, b, m, nullptr);
  }
}

#ifdef WKVM_AMX

// ---- AMX-INT8: a group of 32 k as tiles, 16 rows of x by 16 outputs per tdpbssd ----
// A block's pair rows are interleaved into quads as on the VNNI path (the same lanes, so store_quads serves), written
// group by group as two 8 x 64-byte B tiles (outputs quad_row(0, j) and quad_row(1, j)); x's rows are the A tile (16
// rows of a group's 32 values: a copy with zero rows and values after M and K where those do not fill tiles). tdpbssd
// multiplies signed bytes exactly, so each group's int32 sums are the VNNI path's integers; they are stored and
// added into the fp32 sums by the same one multiply-add per group, so the bits are the same.

#define WKVM_I8_AMX "avx2,fma,avx512f,avx512bw,avx512vnni,amx-tile,amx-int8"

using amx::AMX_ROWS;
using amx::TILE_ROWS;

// 16 rows of x a tile. Two sets, so that one group's tiles are multiplied while the group before is added up:
// tiles 0, 1 (5, 6): a group's int32 sums of the two halves; 2 (7): its x; 3, 4: its weights' two halves
inline amx::TileConfig amx_config() {
  amx::TileConfig c;
  for (int t : {0, 1, 5, 6}) c.set(t, TILE_ROWS, 64);
  for (int t : {2, 7}) c.set(t, TILE_ROWS, X_GROUP);
  for (int t : {3, 4}) c.set(t, X_GROUP / 4, 64);
  return c;
}

// block b's groups as B tiles: group g's are at out + 1,024 g (lo) and + 512 (hi); quads past K are zero
__attribute__((target(WKVM_I8_AMX))) inline void repack_amx(const Problem& p, int64_t b, const int8_t* next,
                                                         int8_t* out) {
  const int8_t* w = block_at(p, b);
  for (int64_t g = 0; g < p.G; ++g) {
    prefetch_share(p, next, g);
    for (int64_t j = 0; j < X_GROUP / 4; ++j) {
      const int64_t k = g * X_GROUP + 4 * j;
      const __m512i a = k + 2 <= p.K ? _mm512_loadu_si512(w + k * BLOCK) : _mm512_setzero_si512();
      const __m512i c = k + 4 <= p.K ? _mm512_loadu_si512(w + (k + 2) * BLOCK) : _mm512_setzero_si512();
      _mm512_store_si512(out + 1024 * g + 64 * j, _mm512_unpacklo_epi16(a, c));
      _mm512_store_si512(out + 1024 * g + 512 + 64 * j, _mm512_unpackhi_epi16(a, c));
    }
  }
}

// rows m .. m + rows of x (at x, `stride` bytes apart; the tiles' rows readable) against a block repacked at `packed`
__attribute__((target(WKVM_I8_AMX))) inline void tile_rows_amx(const Problem& p, int64_t b, int64_t m, int64_t rows,
                                                            const int8_t* x, int64_t stride, const int8_t* packed) {
  alignas(64) int32_t sums[2][2][TILE_ROWS][16];  // [set][half][row][output lane]
  __m512 acc[2][TILE_ROWS];
  for (int h = 0; h < 2; ++h)
    for (int64_t i = 0; i < rows; ++i) acc[h][i] = _mm512_setzero_ps();
// one group's products on tile set (LO, HI sums; X x), their sums stored to OUT[2][TILE_ROWS][16]; tile numbers are
// immediates, so a macro, not a function
#define WKVM_I8_TILE_GROUP(LO, HI, X, xg, stride, bg, out) \
  do {                                                     \
    _tile_zero(LO);                                        \
    _tile_zero(HI);                                        \
    _tile_loadd(X, xg, stride);                            \
    _tile_loadd(3, bg, 64);                                \
    _tile_loadd(4, (bg) + 512, 64);                        \
    _tile_dpbssd(LO, X, 3);                                \
    _tile_dpbssd(HI, X, 4);                                \
    _tile_stored(LO, (out)[0], 64);                        \
    _tile_stored(HI, (out)[1], 64);                        \
  } while (0)
  const auto multiply = [&](int64_t g) {
    const int8_t* bg = packed + 1024 * g;
    if (g % 2 == 0)
      WKVM_I8_TILE_GROUP(0, 1, 2, x + g * X_GROUP, stride, bg, sums[0]);
    else
      WKVM_I8_TILE_GROUP(5, 6, 7, x + g * X_GROUP, stride, bg, sums[1]);
  };
#undef WKVM_I8_TILE_GROUP
  multiply(0);
  for (int64_t g = 0; g < p.G; ++g) {
    if (g + 1 < p.G) multiply(g + 1);
    const int32_t(*set)[TILE_ROWS][16] = sums[g % 2];
    for (int64_t i = 0; i < rows; ++i) {
      const __m512 dx = _mm512_set1_ps(p.xs[(m + i) * p.G + g]);
      for (int h = 0; h < 2; ++h)
        acc[h][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(set[h][i])), dx, acc[h][i]);
    }
  }
  for (int64_t i = 0; i < rows; ++i) store_quads(p, b, m + i, acc[0][i], acc[1][i]);
}

__attribute__((target(WKVM_I8_AMX))) void amx_blocks(const Problem& p, int64_t b0, int64_t b1) {
  if (p.M < AMX_ROWS) return vnni_blocks(p, b0, b1);
  if (b0 >= b1) return;
  // tiles of 16 rows of x; where K is not a multiple of 32 or the last tile is short, x's rows go to a copy padded
  // with zeros (zero x makes the weights' padding irrelevant)
  const int64_t R = TILE_ROWS, Kp = p.G * X_GROUP, tiles = (p.M + R - 1) / R;
  const bool direct = Kp == p.K && p.M % R == 0;
  int8_t* packed = amx::scratch(size_t(1024 * p.G + (direct ? 0 : tiles * R * Kp)));
  const int8_t* x = p.xq;
  if (!direct) {
    int8_t* xp = packed + 1024 * p.G;
    std::memset(xp, 0, size_t(tiles * R * Kp));
    for (int64_t m = 0; m < p.M; ++m) std::memcpy(xp + m * Kp, p.xq + m * p.K, size_t(p.K));
    x = xp;
  }
  const amx::TileConfig config = amx_config();
  _tile_loadconfig(&config);
  for (int64_t b = b0; b < b1; ++b) {
    repack_amx(p, b, b + 1 < b1 ? block_at(p, b + 1) : nullptr, packed);
    for (int64_t m = 0; m < p.M; m += R) tile_rows_amx(p, b, m, std::min(R, p.M - m), x + m * Kp, Kp, packed);
  }
  _tile_release();
}

#endif  // WKVM_AMX

#define WKVM_BLOCKS(NAME, TARGET, MAXT)                                                      \
  __attribute__((target(TARGET))) void NAME##_blocks(const Problem& p, int64_t b0, int64_t b1) { \
    for (int64_t b = b0; b < b1; ++b) {                                                      \
      int64_t m = 0;                                                                         \
      for (; m + MAXT <= p.M; m += MAXT) block_##NAME<MAXT>(p, b, m);                        \
      for (; m + 2 <= p.M; m += 2) block_##NAME<2>(p, b, m);                                 \
      if (m < p.M) block_##NAME<1>(p, b, m);                                                 \
    }                                                                                        \
  }
WKVM_BLOCKS(avx512, WKVM_I8_AVX512, 4)

#endif  // WKVM_X86

int64_t best_isa() {
#ifdef WKVM_X86
  __builtin_cpu_init();
  const bool bw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (bw && __builtin_cpu_supports("avx512vnni")) return amx::usable() ? 4 : 3;
  if (bw) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
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
#ifdef WKVM_AMX
  if (isa == 4) return amx_blocks;
#endif
#endif
  return blocks_scalar;
}

}  // namespace
}  // namespace wkvm::int8

#undef WKVM_I8_AVX512
#undef WKVM_I8_VNNI
#undef WKVM_I8_AMX
#undef WKVM_BLOCKS
