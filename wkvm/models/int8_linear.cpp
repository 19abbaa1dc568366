// y[M, N] = x[M, K] @ dequant(W)^T for weight-only int8 matrices; wkvm/models/int8.py describes the format:
// W is int8 [N, K + 4]; with K even, each whole group of 32 rows is a block of K/2 "pair rows" of 64 bytes (row r's
// weights k and k + 1 at bytes 2r, 2r + 1) followed by the 32 rows' fp32 scales; the rows after the last whole
// block (and all rows when K is odd) are plain: K weights, then the row's scale.
//
// Decode sizes (M up to a few dozen). Each row of x is first rounded to int16 with its own scale (max|x| / 32767: a
// relative step of 3e-5 of the row's largest value, finer than bf16's rounding of x); the products are then exact
// integer multiply-adds (vpmaddwd; vpdpwssd with AVX512-VNNI), 32 per instruction, with no conversion per weight.
// A block feeds 16 (AVX-512) or 8 (AVX2) output rows per register, so x's pairs are broadcast and no horizontal sums
// are needed, and the matrix is read as one sequential stream (2 or 4 plain rows read side by side ran at a third
// of the read bandwidth on the development machine). Partial sums leave the int32 lanes for int64 before they can
// overflow, so every path (portable, AVX2, AVX-512, VNNI) returns the same bits. Output rows are split across
// torch's own thread pool (at::parallel_for), so no second OpenMP runtime spins beside oneDNN's. One build serves
// every x86 CPU: the vector kernels carry target attributes and the caller picks one (isa: 0 portable C++, 1 AVX2,
// 2 AVX-512BW, 3 AVX512-VNNI); best_isa() says what this CPU runs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define WKVM_X86 1
#endif

namespace {

constexpr int64_t BLOCK = 32;
// plain rows: inputs per int32 flush (a lane sums at most 2048 / 16 vpmaddwd results of 2 * 127 * 32767, < 2^31)
constexpr int64_t CHUNK = 2048;
// blocks: pair rows per int32 flush (a lane sums one vpmaddwd result per pair row: 256 * 2 * 127 * 32767 < 2^31)
constexpr int64_t PAIRS = 256;

struct Problem {
  const int16_t* x;  // [M, K] x rounded to int16
  const float* xs;   // [M] x's row scales
  const int8_t* w;   // [N, K + 4]
  float* y;          // [M, N]
  int64_t M, N, K, blocks;
};

inline float load_float(const int8_t* p) {
  float s;
  std::memcpy(&s, p, sizeof s);
  return s;
}

inline const int8_t* block_at(const Problem& p, int64_t b) { return p.w + b * BLOCK * (p.K + 4); }

inline float scale_of(const Problem& p, int64_t n) {
  if (n < p.blocks * BLOCK) return load_float(block_at(p, n / BLOCK) + BLOCK * p.K + 4 * (n % BLOCK));
  return load_float(p.w + n * (p.K + 4) + p.K);
}

inline void store(const Problem& p, int64_t m, int64_t n, int64_t total) {
  p.y[m * p.N + n] = static_cast<float>(static_cast<double>(total) * p.xs[m] * scale_of(p, n));
}

// a block's output rows m..m+MT from its int64 totals [MT][32]
template <int MT>
inline void store_block(const Problem& p, int64_t b, int64_t m, const int64_t (&tot)[MT][BLOCK]) {
  for (int i = 0; i < MT; ++i)
    for (int64_t r = 0; r < BLOCK; ++r) store(p, m + i, b * BLOCK + r, tot[i][r]);
}

// x's rows to int16 with their own scales. The AVX2 version (used by every vector path) gives the same bits: max is
// exact in any order, the scale is computed alike, and cvtps rounds to nearest even as the ROUND trick does.
constexpr float QMAX = 32767.f;

inline float amax_scalar(const float* r, int64_t k0, int64_t K, float amax) {
  for (int64_t k = k0; k < K; ++k) {
    const float a = std::fabs(r[k]);
    amax = a > amax ? a : amax;
  }
  return amax;
}

inline void round_scalar(const float* r, int64_t k0, int64_t K, float inv, int16_t* q) {
  constexpr float ROUND = 12582912.f;  // 1.5 * 2^23: adding then subtracting it rounds to nearest, ties to even
  for (int64_t k = k0; k < K; ++k) {
    float v = r[k] * inv;
    v = v > QMAX ? QMAX : (v < -QMAX ? -QMAX : v);
    q[k] = static_cast<int16_t>(static_cast<int32_t>((v + ROUND) - ROUND));
  }
}

inline float inverse(float amax) { return amax > 0.f ? QMAX / amax : 0.f; }

void quantize_row_scalar(const float* r, int64_t K, int16_t* q, float* scale) {
  const float amax = amax_scalar(r, 0, K, 0.f);
  *scale = amax / QMAX;
  round_scalar(r, 0, K, inverse(amax), q);
}

#ifdef WKVM_X86
__attribute__((target("avx2"))) void quantize_row_avx2(const float* r, int64_t K, int16_t* q, float* scale) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(r + k), abs_mask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  const float amax = amax_scalar(r, k, K, amax_scalar(lanes, 0, 8, 0.f));
  *scale = amax / QMAX;
  const float inv = inverse(amax);
  const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(QMAX), lo = _mm256_set1_ps(-QMAX);
  for (k = 0; k + 16 <= K; k += 16) {
    const __m256 va = _mm256_mul_ps(_mm256_loadu_ps(r + k), vinv), vb = _mm256_mul_ps(_mm256_loadu_ps(r + k + 8), vinv);
    const __m256i a = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, va)));
    const __m256i b = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, vb)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
  }
  round_scalar(r, k, K, inv, q);
}
#endif

void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* q, float* scale, int64_t isa) {
  void (*row)(const float*, int64_t, int16_t*, float*) = quantize_row_scalar;
#ifdef WKVM_X86
  if (isa >= 1) row = quantize_row_avx2;
#endif
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) row(x + m * K, K, q + m * K, scale + m);
  });
}

inline int64_t dot_scalar(const int16_t* x, const int8_t* w, int64_t k0, int64_t k1) {
  int64_t t = 0;
  for (int64_t k = k0; k < k1; ++k) t += int32_t(x[k]) * int32_t(w[k]);
  return t;
}

// ---- portable C++ (the reference the vector paths must equal bit for bit) ----

void blocks_scalar(const Problem& p, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* w = block_at(p, b);
    for (int64_t m = 0; m < p.M; ++m) {
      const int16_t* x = p.x + m * p.K;
      for (int64_t r = 0; r < BLOCK; ++r) {
        int64_t t = 0;
        for (int64_t k = 0; k < p.K; k += 2)
          t += int32_t(x[k]) * w[k * BLOCK + 2 * r] + int32_t(x[k + 1]) * w[k * BLOCK + 2 * r + 1];
        store(p, m, b * BLOCK + r, t);
      }
    }
  }
}

void rows_scalar(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < p.M; ++m) store(p, m, n, dot_scalar(p.x + m * p.K, p.w + n * (p.K + 4), 0, p.K));
}

#ifdef WKVM_X86

// ---- AVX2: 8 output rows per register ----

__attribute__((target("avx2"))) inline void add_epi32_to(int64_t* tot, __m256i v) {
  __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tot));
  __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tot + 4));
  lo = _mm256_add_epi64(lo, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)));
  hi = _mm256_add_epi64(hi, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(tot), lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(tot + 4), hi);
}

__attribute__((target("avx2"))) inline int64_t hsum_epi32(__m256i v) {
  alignas(32) int64_t t[8] = {};
  add_epi32_to(t, v);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}

template <int MT>
__attribute__((target("avx2"))) void block_avx2(const Problem& p, int64_t b, int64_t m) {
  const int8_t* w = block_at(p, b);
  int64_t tot[MT][BLOCK] = {};
  for (int64_t k0 = 0; k0 < p.K; k0 += 2 * PAIRS) {
    __m256i acc[4][MT];
    for (int q = 0; q < 4; ++q)
      for (int i = 0; i < MT; ++i) acc[q][i] = _mm256_setzero_si256();
    for (int64_t k = k0; k < std::min(p.K, k0 + 2 * PAIRS); k += 2) {
      __m256i wv[4];
      for (int q = 0; q < 4; ++q)
        wv[q] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * BLOCK + 16 * q)));
      for (int i = 0; i < MT; ++i) {
        int32_t pair;
        std::memcpy(&pair, p.x + (m + i) * p.K + k, sizeof pair);
        const __m256i xv = _mm256_set1_epi32(pair);
        for (int q = 0; q < 4; ++q) acc[q][i] = _mm256_add_epi32(acc[q][i], _mm256_madd_epi16(wv[q], xv));
      }
    }
    for (int q = 0; q < 4; ++q)
      for (int i = 0; i < MT; ++i) add_epi32_to(tot[i] + 8 * q, acc[q][i]);
  }
  store_block<MT>(p, b, m, tot);
}

__attribute__((target("avx2"))) void blocks_avx2(const Problem& p, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    int64_t m = 0;
    for (; m + 2 <= p.M; m += 2) block_avx2<2>(p, b, m);
    if (m < p.M) block_avx2<1>(p, b, m);
  }
}

// plain rows: one row at a time against MT rows of x (16 weights per step)
template <int MT>
__attribute__((target("avx2"))) void row_avx2(const Problem& p, int64_t n, int64_t m) {
  const int64_t K16 = p.K & ~int64_t(15);
  const int8_t* w = p.w + n * (p.K + 4);
  int64_t total[MT] = {};
  for (int64_t k0 = 0; k0 < K16; k0 += CHUNK) {
    __m256i acc[MT];
    for (int i = 0; i < MT; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t k = k0; k < std::min(K16, k0 + CHUNK); k += 16) {
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)));
      for (int i = 0; i < MT; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.x + (m + i) * p.K + k));
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(wv, xv));
      }
    }
    for (int i = 0; i < MT; ++i) total[i] += hsum_epi32(acc[i]);
  }
  for (int i = 0; i < MT; ++i) store(p, m + i, n, total[i] + dot_scalar(p.x + (m + i) * p.K, w, K16, p.K));
}

__attribute__((target("avx2"))) void rows_avx2(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 4 <= p.M; m += 4) row_avx2<4>(p, n, m);
    for (; m < p.M; ++m) row_avx2<1>(p, n, m);
  }
}

// ---- AVX-512BW and AVX512-VNNI: 16 output rows per register ----

#define WKVM_AVX512 "avx2,avx512f,avx512bw"
#define WKVM_VNNI "avx2,avx512f,avx512bw,avx512vnni"

__attribute__((target(WKVM_AVX512))) inline void add_epi32x16_to(int64_t* tot, __m512i v) {
  __m512i lo = _mm512_loadu_si512(tot), hi = _mm512_loadu_si512(tot + 8);
  lo = _mm512_add_epi64(lo, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)));
  hi = _mm512_add_epi64(hi, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1)));
  _mm512_storeu_si512(tot, lo);
  _mm512_storeu_si512(tot + 8, hi);
}

__attribute__((target(WKVM_AVX512))) inline int64_t hsum_epi32x16(__m512i v) {
  return _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(v))) +
         _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1)));
}

// NAME_block: a block against up to 8 rows of x; NAME_blocks: whole blocks b0..b1; NAME_rows: plain rows n0..n1
#define WKVM_KERNELS512(NAME, TARGET, MADD)                                                                   \
  template <int MT>                                                                                           \
  __attribute__((target(TARGET))) void NAME##_block(const Problem& p, int64_t b, int64_t m) {                 \
    const int8_t* w = block_at(p, b);                                                                         \
    int64_t tot[MT][BLOCK] = {};                                                                              \
    for (int64_t k0 = 0; k0 < p.K; k0 += 2 * PAIRS) {                                                         \
      __m512i acc[2][MT];                                                                                     \
      for (int h = 0; h < 2; ++h)                                                                             \
        for (int i = 0; i < MT; ++i) acc[h][i] = _mm512_setzero_si512();                                      \
      for (int64_t k = k0; k < std::min(p.K, k0 + 2 * PAIRS); k += 2) {                                       \
        const int8_t* pair_row = w + k * BLOCK;                                                               \
        const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair_row))); \
        const __m512i w1 =                                                                                    \
            _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair_row + 32)));        \
        for (int i = 0; i < MT; ++i) {                                                                        \
          int32_t pair;                                                                                       \
          std::memcpy(&pair, p.x + (m + i) * p.K + k, sizeof pair);                                           \
          const __m512i xv = _mm512_set1_epi32(pair);                                                         \
          acc[0][i] = MADD(acc[0][i], w0, xv);                                                                \
          acc[1][i] = MADD(acc[1][i], w1, xv);                                                                \
        }                                                                                                     \
      }                                                                                                       \
      for (int h = 0; h < 2; ++h)                                                                             \
        for (int i = 0; i < MT; ++i) add_epi32x16_to(tot[i] + 16 * h, acc[h][i]);                             \
    }                                                                                                         \
    store_block<MT>(p, b, m, tot);                                                                            \
  }                                                                                                           \
  __attribute__((target(TARGET))) void NAME##_blocks(const Problem& p, int64_t b0, int64_t b1) {              \
    for (int64_t b = b0; b < b1; ++b) {                                                                       \
      int64_t m = 0;                                                                                          \
      for (; m + 8 <= p.M; m += 8) NAME##_block<8>(p, b, m);                                                  \
      switch (p.M - m) {                                                                                      \
        case 7: NAME##_block<7>(p, b, m); break;                                                              \
        case 6: NAME##_block<6>(p, b, m); break;                                                              \
        case 5: NAME##_block<5>(p, b, m); break;                                                              \
        case 4: NAME##_block<4>(p, b, m); break;                                                              \
        case 3: NAME##_block<3>(p, b, m); break;                                                              \
        case 2: NAME##_block<2>(p, b, m); break;                                                              \
        case 1: NAME##_block<1>(p, b, m); break;                                                              \
        default: break;                                                                                       \
      }                                                                                                       \
    }                                                                                                         \
  }                                                                                                           \
  template <int MT>                                                                                           \
  __attribute__((target(TARGET))) void NAME##_row(const Problem& p, int64_t n, int64_t m) {                   \
    const int64_t K32 = p.K & ~int64_t(31);                                                                   \
    const int8_t* w = p.w + n * (p.K + 4);                                                                    \
    int64_t total[MT] = {};                                                                                   \
    for (int64_t k0 = 0; k0 < K32; k0 += CHUNK) {                                                             \
      __m512i acc[MT];                                                                                        \
      for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_si512();                                           \
      for (int64_t k = k0; k < std::min(K32, k0 + CHUNK); k += 32) {                                          \
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k))); \
        for (int i = 0; i < MT; ++i) acc[i] = MADD(acc[i], wv, _mm512_loadu_si512(p.x + (m + i) * p.K + k));  \
      }                                                                                                       \
      for (int i = 0; i < MT; ++i) total[i] += hsum_epi32x16(acc[i]);                                         \
    }                                                                                                         \
    for (int i = 0; i < MT; ++i) store(p, m + i, n, total[i] + dot_scalar(p.x + (m + i) * p.K, w, K32, p.K)); \
  }                                                                                                           \
  __attribute__((target(TARGET))) void NAME##_rows(const Problem& p, int64_t n0, int64_t n1) {                \
    for (int64_t n = n0; n < n1; ++n) {                                                                       \
      int64_t m = 0;                                                                                          \
      for (; m + 4 <= p.M; m += 4) NAME##_row<4>(p, n, m);                                                    \
      for (; m < p.M; ++m) NAME##_row<1>(p, n, m);                                                            \
    }                                                                                                         \
  }

#define WKVM_MADD_BW(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#define WKVM_MADD_VNNI(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
WKVM_KERNELS512(avx512, WKVM_AVX512, WKVM_MADD_BW)
WKVM_KERNELS512(vnni, WKVM_VNNI, WKVM_MADD_VNNI)

#endif  // WKVM_X86

int64_t best_isa() {
#ifdef WKVM_X86
  __builtin_cpu_init();
  const bool bw = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (bw && __builtin_cpu_supports("avx512vnni")) return 3;
  if (bw) return 2;
  if (__builtin_cpu_supports("avx2")) return 1;
#endif
  return 0;
}

void check_weights(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.device().is_cpu(),
              "w: contiguous int8 [N, K + 4] on the CPU");
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t isa) {
  check_weights(w);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x: contiguous float32 [M, K] on the CPU");
  TORCH_CHECK(w.size(1) == x.size(1) + 4, "w rows must hold K = x.size(1) weights and a float32 scale");
  TORCH_CHECK(isa >= 0 && isa <= best_isa(), "this CPU cannot run kernel isa ", isa);
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  std::unique_ptr<int16_t[]> xq(new int16_t[M * K]);  // uninitialized: every element is written
  std::vector<float> xs(M);
  quantize_rows(x.data_ptr<float>(), M, K, xq.get(), xs.data(), isa);
  at::Tensor y = at::empty({M, N}, x.options());
  const Problem p{xq.get(), xs.data(), w.data_ptr<int8_t>(), y.data_ptr<float>(), M, N, K, K % 2 ? 0 : N / BLOCK};
  void (*blocks)(const Problem&, int64_t, int64_t) = blocks_scalar;
  void (*rows)(const Problem&, int64_t, int64_t) = rows_scalar;
#ifdef WKVM_X86
  if (isa == 1) blocks = blocks_avx2, rows = rows_avx2;
  if (isa == 2) blocks = avx512_blocks, rows = avx512_rows;
  if (isa == 3) blocks = vnni_blocks, rows = vnni_rows;
#endif
  // each thread a contiguous band, at least ~64 KiB of weights, so that its share is worth waking it for
  const int64_t grain_rows = std::max<int64_t>(1, (int64_t(1) << 16) / (K + 4));
  at::parallel_for(0, p.blocks, (grain_rows + BLOCK - 1) / BLOCK, [&](int64_t b0, int64_t b1) { blocks(p, b0, b1); });
  at::parallel_for(p.blocks * BLOCK, N, grain_rows, [&](int64_t n0, int64_t n1) { rows(p, n0, n1); });
  return y;
}

// W -> fp32 [N, K] in one parallel pass (prefill multiplies that with oneDNN's fp32 GEMM).
at::Tensor dequantize(const at::Tensor& w) {
  check_weights(w);
  const int64_t N = w.size(0), K = w.size(1) - 4;
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  const Problem p{nullptr, nullptr, w.data_ptr<int8_t>(), out.data_ptr<float>(), 0, N, K, K % 2 ? 0 : N / BLOCK};
  at::parallel_for(0, N, std::max<int64_t>(BLOCK, (int64_t(1) << 16) / (K + 4)), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float s = scale_of(p, n);
      float* dst = p.y + n * K;
      if (n < p.blocks * BLOCK) {
        const int8_t* src = block_at(p, n / BLOCK) + 2 * (n % BLOCK);
        for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(src[(k & ~int64_t(1)) * BLOCK + (k & 1)]) * s;
      } else {
        const int8_t* src = p.w + n * (K + 4);
        for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(src[k]) * s;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(wkvm_int8, m) {
  m.def("linear(Tensor x, Tensor w, int isa) -> Tensor", &linear);
  m.def("dequantize(Tensor w) -> Tensor", &dequantize);
  m.def("best_isa() -> int", &best_isa);
}
