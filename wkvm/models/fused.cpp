// Fused per-layer ops for decode-sized steps (issues #16, #21): each replaces a chain of small torch ops whose
// dispatch, not arithmetic, dominates a one-token step. wkvm/models/fused.py builds this file on first use (like
// the int8/int4 kernels) and keeps a torch fallback for each op; every op computes in fp32.
//
//   rms_norm(x [N, C], w [C], eps)            -> x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm(x [N, C], a [N, C], w, eps)  -> (x + a, rms_norm(x + a))
//   silu_mul(gu [N, 2F])                      -> silu(gu[:, :F]) * gu[:, F:]
//   greedy(logits [B, V])                     -> (first index of each row's max, whether the row is all finite)
//   sample(logits [V], temperature, top_k, top_p, min_p, u, counts?, seen?, frequency, presence, repetition)
//     -> a token drawn with uniform u, or -1 (no valid distribution): the sampler's apply_penalties, filtered_probs
//     and draw (wkvm/engine/sampler.py) in a few passes over the row
//   rope_attend(q [B, (1,) Hq, D], k, v [B, (1,) Hkv, D], cos, sin [B, R], kflat, vflat [S, Hkv, D],
//               table [B, P] int64, lengths [B] int64, page_tokens, scale) -> q's shape
//     One new token per row: RoPE (HF half-split pairs over the first R dims) on q and k, k and v written to the
//     row's slot at position lengths[b] (slot = table[b][pos / page_tokens] * page_tokens + pos % page_tokens),
//     then grouped-query attention of q over the row's lengths[b] + 1 cached tokens, read page by page in place
//     (query head h uses kv head h / (Hq / Hkv), HF's repeat_kv order). Work items are (row, CHUNK tokens) on
//     torch's thread pool, merged per row afterwards (flash-decoding). The pools are float32 or float16 (`--kv-dtype`;
//     D a multiple of 8): float16 keys and values are rounded when written and widened to fp32 when read. A prompt
//     chunk's tokens as rows (rows reading the same pages) share each chunk of keys, transposed once, and of values:
//     the same bits as one row at a time (Attention::group; with AVX-512, or AVX2 with FMA).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <memory>
#include <functional>
#include <optional>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

#include "linear_call.h"
#include "simd_math.h"
#include "x_groups.h"
// the int8 and int4 kernels' blocks, compiled here as their own libraries compile them (no contraction): the same bits
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#include "int4_blocks.h"
#include "int8_blocks.h"
#pragma GCC pop_options

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using wkvm::exp_approx;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), name, " must be a CPU float32 tensor");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [N, C] with contiguous rows");
}

// The row helpers are not inlined: the ops below and the one-region Llama layer call the same compiled code, so a
// row's reduction order (and its bits) cannot depend on the caller it was inlined into.
__attribute__((noinline)) void norm_row(const float* x, const float* w, float* y, int64_t C, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(C) + eps);
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) y[c] = x[c] * inv * w[c];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kFloat && w.numel() == x.size(1), "w must be [C] float32");
  const int64_t N = x.size(0), C = x.size(1), sx = x.stride(0);
  at::Tensor y = at::empty({N, C}, x.options());
  const float *px = x.data_ptr<float>(), *pw = w.data_ptr<float>();
  float* py = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(px + r * sx, pw, py + r * C, C, static_cast<float>(eps));
  });
  return y;
}

// s = x + a, y = rms_norm(s)
__attribute__((noinline)) void add_norm_row(const float* x, const float* a, const float* w, float* s, float* y,
                                            int64_t C, float eps) {
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) s[c] = x[c] + a[c];
  norm_row(s, w, y, C, eps);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& a, const at::Tensor& w,
                                                double eps) {
  check_rows(x, "x");
  check_rows(a, "a");
  TORCH_CHECK(a.size(0) == x.size(0) && a.size(1) == x.size(1), "x and a must have the same shape");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kFloat && w.numel() == x.size(1), "w must be [C] float32");
  const int64_t N = x.size(0), C = x.size(1), sx = x.stride(0), sa = a.stride(0);
  at::Tensor s = at::empty({N, C}, x.options()), y = at::empty({N, C}, x.options());
  const float *px = x.data_ptr<float>(), *pa = a.data_ptr<float>(), *pw = w.data_ptr<float>();
  float *ps = s.data_ptr<float>(), *py = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) add_norm_row(px + r * sx, pa + r * sa, pw, ps + r * C, py + r * C, C, eps);
  });
  return {s, y};
}

// out[c] = silu(gu[c]) * gu[F + c] for c in c0 .. c1 of one row
__attribute__((noinline)) void silu_span(const float* gu, float* out, int64_t F, int64_t c0, int64_t c1) {
  const float *g = gu, *u = gu + F;
#pragma omp simd
  for (int64_t c = c0; c < c1; ++c) out[c] = g[c] / (1.0f + exp_approx(-g[c])) * u[c];
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "gu");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gu must have an even number of columns");
  const int64_t N = gu.size(0), F = gu.size(1) / 2, sg = gu.stride(0);
  at::Tensor y = at::empty({N, F}, gu.options());
  const float* pg = gu.data_ptr<float>();
  float* py = y.data_ptr<float>();
  at::parallel_for(0, N * F, 16384, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {
      const int64_t r = i / F, c0 = i % F, c1 = std::min(F, c0 + (i1 - i));
      silu_span(pg + r * sg, py + r * F, F, c0, c1);
      i += c1 - c0;
    }
  });
  return y;
}

// x [D] rotated into out (times mul): pairs (j, j + R/2) for j < R/2 turn by (cos, sin) [R] (both halves repeat the
// angles); dims from R on pass through.
inline void rope(const float* x, const float* cos, const float* sin, float* out, int64_t D, int64_t R, float mul) {
  const int64_t h = R / 2;
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) {
    out[j] = (x[j] * cos[j] - x[j + h] * sin[j]) * mul;
    out[j + h] = (x[j + h] * cos[j + h] + x[j] * sin[j + h]) * mul;
  }
  for (int64_t j = R; j < D; ++j) out[j] = x[j] * mul;
}

// Where token t of a row lives: its page's first slot plus t's offset in the page.
struct Pages {
  const int64_t* table;
  int64_t page_tokens;
  int64_t slot(int64_t t) const { return table[t / page_tokens] * page_tokens + t % page_tokens; }
  // f(first token, token count, the first token's slot, the next run's count and first slot) for each run of tokens
  // t0..t1-1 within one page (the next run's count is 0 after the last)
  template <class F>
  void each(int64_t t0, int64_t t1, const F& f) const {
    int64_t count = std::min(page_tokens - t0 % page_tokens, t1 - t0), at = t0 < t1 ? slot(t0) : 0;
    for (int64_t t = t0; t < t1;) {
      const int64_t next = t + count, next_count = std::min(page_tokens, t1 - next);
      const int64_t next_at = next < t1 ? slot(next) : 0;
      f(t, count, at, next_count > 0 ? next_count : 0, next_at);
      t = next, count = next_count, at = next_at;
    }
  }
};

typedef float v8f __attribute__((vector_size(32)));  // 8 floats: one AVX2 register, half an AVX-512 one
typedef float v4f __attribute__((vector_size(16)));

// the four sums of a0..a3's lanes, without going through memory
inline v4f hsum4(v8f a0, v8f a1, v8f a2, v8f a3) {
  const v4f b0 = __builtin_shufflevector(a0, a0, 0, 1, 2, 3) + __builtin_shufflevector(a0, a0, 4, 5, 6, 7);
  const v4f b1 = __builtin_shufflevector(a1, a1, 0, 1, 2, 3) + __builtin_shufflevector(a1, a1, 4, 5, 6, 7);
  const v4f b2 = __builtin_shufflevector(a2, a2, 0, 1, 2, 3) + __builtin_shufflevector(a2, a2, 4, 5, 6, 7);
  const v4f b3 = __builtin_shufflevector(a3, a3, 0, 1, 2, 3) + __builtin_shufflevector(a3, a3, 4, 5, 6, 7);
  const v4f c0 = __builtin_shufflevector(b0, b1, 0, 4, 1, 5) + __builtin_shufflevector(b0, b1, 2, 6, 3, 7);
  const v4f c1 = __builtin_shufflevector(b2, b3, 0, 4, 1, 5) + __builtin_shufflevector(b2, b3, 2, 6, 3, 7);
  return __builtin_shufflevector(c0, c1, 0, 1, 4, 5) + __builtin_shufflevector(c0, c1, 2, 3, 6, 7);
}

using half = at::Half;  // a KV pool's element in float16 (c10's type: any compiler; vectors convert with F16C)

inline float dot(const float* a, const float* b, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// Tokens are read this far ahead of use: each takes little arithmetic, so without it the loop waits on memory for
// every token of a cache that is not in cache (measured: 3-4x slower than hot). The next page's first tokens are
// asked for when a page starts.
constexpr int64_t AHEAD = 8;

// Decode attention splits each row into chunks of this many tokens (a multiple of 4 and of usual page sizes, so the
// 4-token blocks fall the same way in a paged and in a dense cache).
constexpr int64_t CHUNK = 128;

// Into L2, not L1 (prefetcht1): a decode step's cache comes from memory (the layer's weights passed through since),
// and asked into L1 the same rows arrived at about a third of the pure-read rate; into L2 the op ran 1.3-1.5x faster
// (AMD EPYC, avx512, 2 threads: batch 8 at 60 and 1,000 tokens, one row at 1,000 and 4,000, float32 and float16
// pools, each layer's call after 4.9 MB of other reads; hot, level). AHEAD 16 was slower in all four cases, 4
// between 6% faster and 10% slower than 8. (Session 41, same VM: no measurable effect either way, on or off; the
// loads of `touch` below did what these were for. Kept: they cost little, and another CPU may honour them.)
template <class T>
inline void prefetch_rows(const T* p, int64_t values) {
  for (int64_t f = 0; f < values; f += 64 / sizeof(T)) __builtin_prefetch(p + f, 0, 2);
}

struct Heads {
  int64_t Hq, Hkv, G, D, HD;  // query heads, kv heads, queries per kv head, head size, floats per token
};

// One load of every 64-byte line of tokens t0..t1-1's keys and values, before their arithmetic. A decode step's
// cache comes from memory (the layer's weights passed through since); loads that depend on nothing bring its lines in
// at the memory's rate, where the arithmetic's own loads did not. Measured (AMD EPYC Zen 4, session 41): the op from
// memory 1.05-1.8x faster (one row at 1,000 and 8,000 tokens, eight at 48 and 1,000, float32 and float16 pools, 1-2
// threads); SmolLM2 int8 decode after 8,000 tokens 1.10-1.20x (47.7 -> 57.4 tok/s), short contexts level; float32
// pools only (below). The software prefetches
// (`prefetch_rows`: any hint, one page to 96 KB ahead, all of an item's lines at once, or none at all) left the op's
// time unchanged on that host, which honours them elsewhere (random reads). The values read are only kept from being
// optimized away.
template <class T>
void touch(const T* kf, const T* vf, const Pages& pg, int64_t t0, int64_t t1, const Heads& hs) {
  unsigned sink = 0;
  pg.each(t0, t1, [&](int64_t, int64_t count, int64_t slot, int64_t, int64_t) {
    const unsigned char* k = reinterpret_cast<const unsigned char*>(kf + slot * hs.HD);
    const unsigned char* v = reinterpret_cast<const unsigned char*>(vf + slot * hs.HD);
    const int64_t bytes = count * hs.HD * static_cast<int64_t>(sizeof(T));
    for (int64_t b = 0; b < bytes; b += 64) sink += k[b] + v[b];
  });
  asm volatile("" : : "r"(sink));
}

typedef float v16f __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register, two AVX2 ones

template <class V>
inline V load_vec(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// as many halves as V has floats, widened with F16C / AVX-512 conversions (a plain loop over halves stays scalar)
template <class V>
inline V load_vec(const half* p) {
  V v;
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) {
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    std::memcpy(&v, &f, sizeof v);
    return v;
  }
#endif
#if defined(__F16C__)
  for (size_t i = 0; i < sizeof(V) / 32; ++i) {
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * i)));
    std::memcpy(reinterpret_cast<char*>(&v) + 32 * i, &f, sizeof f);
  }
#else
  for (size_t i = 0; i < sizeof(V) / 4; ++i) v[i] = static_cast<float>(p[i]);
#endif
  return v;
}

// q . k for a float16 key (D a multiple of 8, as float16 pools require): eight lanes, then their sum
inline float dot(const float* a, const half* b, int64_t D) {
  v8f s = {};
  for (int64_t d = 0; d < D; d += 8) s += load_vec<v8f>(a + d) * load_vec<v8f>(b + d);
  const v4f h = __builtin_shufflevector(s, s, 0, 1, 2, 3) + __builtin_shufflevector(s, s, 4, 5, 6, 7);
  return (h[0] + h[2]) + (h[1] + h[3]);
}

inline v8f halves(v16f a) {
  return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline v8f halves(v8f a) { return a; }

// The scores of a page's tokens 0..count-1 four at a time (returns how many it did), vectors of V along d: every
// head of a token in one pass over its row of the pool, four tokens' sums reduced in registers. scores points at
// the page's first token of head 0 (row stride m). GS query heads of a kv head at a time share each key vector
// loaded (GS divides the group size; 1 for any group).
template <class V, class T, int GS>
int64_t scores4(const float* qr, const T* kp, int64_t count, const Heads& hs, float* scores, int64_t m) {
  constexpr int64_t L = sizeof(V) / sizeof(float);
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) {
    if (i + AHEAD < count) prefetch_rows(kp + (i + AHEAD) * hs.HD, std::min<int64_t>(4, count - i - AHEAD) * hs.HD);
    for (int64_t j = 0; j < hs.Hkv; ++j) {
      const T* k0 = kp + i * hs.HD + j * hs.D;
      for (int64_t h0 = j * hs.G; h0 < (j + 1) * hs.G; h0 += GS) {
        V a[GS][4];
        for (int g = 0; g < GS; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = V{};
        for (int64_t d = 0; d < hs.D; d += L) {
          const V x0 = load_vec<V>(k0 + d), x1 = load_vec<V>(k0 + hs.HD + d), x2 = load_vec<V>(k0 + 2 * hs.HD + d),
                  x3 = load_vec<V>(k0 + 3 * hs.HD + d);
          for (int g = 0; g < GS; ++g) {
            const V qv = load_vec<V>(qr + (h0 + g) * hs.D + d);
            a[g][0] += qv * x0;
            a[g][1] += qv * x1;
            a[g][2] += qv * x2;
            a[g][3] += qv * x3;
          }
        }
        for (int g = 0; g < GS; ++g) {
          const v4f s4 = hsum4(halves(a[g][0]), halves(a[g][1]), halves(a[g][2]), halves(a[g][3]));
          std::memcpy(scores + (h0 + g) * m + i, &s4, sizeof s4);
        }
      }
    }
  }
  return i;
}

// The sums of a[0..15]'s lanes as one vector (lane p: a[p]'s sum), each added in hsum4's order (lanes i + i+8, then
// i + i+4, i + i+2, i + i+1): the same bits as the four-token path gives the same token. 31 shuffles and 15 adds
// for 16 sums, where scores4 writes 88 and 44 (per four sums: four `halves` and an hsum4). Alone this was level in a
// paired run; with the query held in registers and one moving key pointer (scores16) the op ran 1.03-1.07x.
inline v16f hsum16(const v16f (&a)[16]) {
  v16f c[8], e[4], g[2];
  for (int k = 0; k < 8; ++k)  // c[k]: halves of a[2k] (lanes 0-7), of a[2k+1] (8-15)
    c[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * k], a[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; ++k)  // e[k]: four lanes each of a[4k..4k+3]
    e[k] = __builtin_shufflevector(c[2 * k], c[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(c[2 * k], c[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)  // g[k], block b: two lanes of a[8k + b], two of a[8k + 4 + b]
    g[k] = __builtin_shufflevector(e[2 * k], e[2 * k + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(e[2 * k], e[2 * k + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  // r, block b: the sums of a[b], a[4 + b], a[8 + b], a[12 + b]; then into token order
  const v16f r = __builtin_shufflevector(g[0], g[1], 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
                 __builtin_shufflevector(g[0], g[1], 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
  return __builtin_shufflevector(r, r, 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// scores4 sixteen tokens at a time, one query head at a time, for a float32 cache where 16 sums fit in registers:
// one reduction for 16 sums (hsum16), the head's ND query vectors held in registers over the 16 tokens, and one
// moving pointer for the key rows (sixteen row pointers spilled). The same bits as scores4<.., 1> (each sum takes d
// in the same order and is reduced in the same order). Returns how many tokens it did.
template <int ND>
int64_t scores16(const float* qr, const float* kp, int64_t count, const Heads& hs, float* scores, int64_t m) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    if (i + AHEAD < count) prefetch_rows(kp + (i + AHEAD) * hs.HD, std::min<int64_t>(16, count - i - AHEAD) * hs.HD);
    for (int64_t h = 0; h < hs.Hq; ++h) {
      v16f q[ND];
      for (int d = 0; d < ND; ++d) q[d] = load_vec<v16f>(qr + h * hs.D + 16 * d);
      const float* k = kp + i * hs.HD + (h / hs.G) * hs.D;
      v16f a[16];
      for (int t = 0; t < 16; ++t, k += hs.HD) {
        a[t] = v16f{};  // not q[0] * k: GCC may then contract that product, not the next, into the first FMA
        for (int d = 0; d < ND; ++d) a[t] += q[d] * load_vec<v16f>(k + 16 * d);
      }
      const v16f s16 = hsum16(a);
      std::memcpy(scores + h * m + i, &s16, sizeof s16);
    }
  }
  return i;
}

// scores4<v16f, half, G> eight tokens at a time for a float16 cache: the group's G query heads share each key vector
// widened once (8 G sums in registers, G <= 3), and the sums are reduced two heads at a time by hsum16 (lanes 0-7:
// head g's eight tokens, 8-15: head g + 1's; the last alone for odd G) instead of four `halves` and an hsum4 per head
// and four tokens: 2.9-3.8 shuffles and adds a sum where scores4 takes 8.25. The same bits (each sum takes d in the
// same order and is reduced in hsum4's; checked on SmolLM2's logits, steps and chunks, pages of 4 and 16). Measured
// (SmolLM2 int8, float16 pages, G = 3, AMD EPYC, separate processes alternating; session 42): engine prefill of
// 4,000 tokens 1.08-1.10x, of 8,000 1.08x; one stream's decode after 4,000 tokens 1.01-1.035x, after 8,000
// 1.02-1.06x. Returns how many tokens it did.
template <int G>
int64_t scores8h(const float* qr, const half* kp, int64_t count, const Heads& hs, float* scores, int64_t m) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    if (i + AHEAD < count) prefetch_rows(kp + (i + AHEAD) * hs.HD, std::min<int64_t>(8, count - i - AHEAD) * hs.HD);
    for (int64_t j = 0; j < hs.Hkv; ++j) {
      const half* k0 = kp + i * hs.HD + j * hs.D;
      const float* q0 = qr + j * G * hs.D;
      v16f a[G][8];
      for (int g = 0; g < G; ++g)
        for (int t = 0; t < 8; ++t) a[g][t] = v16f{};
      for (int64_t d = 0; d < hs.D; d += 16) {
        v16f q[G];
        for (int g = 0; g < G; ++g) q[g] = load_vec<v16f>(q0 + g * hs.D + d);
        for (int t = 0; t < 8; ++t) {
          const v16f x = load_vec<v16f>(k0 + t * hs.HD + d);
          for (int g = 0; g < G; ++g) a[g][t] += q[g] * x;
        }
      }
      for (int g = 0; g < G; g += 2) {
        v16f both[16];
        for (int t = 0; t < 8; ++t) {
          both[t] = a[g][t];
          both[8 + t] = g + 1 < G ? a[g + 1][t] : v16f{};
        }
        const v16f s = hsum16(both);
        float* out = scores + (j * G + g) * m + i;
        std::memcpy(out, &s, 8 * sizeof(float));
        if (g + 1 < G) std::memcpy(out + m, reinterpret_cast<const float*>(&s) + 8, 8 * sizeof(float));
      }
    }
  }
  return i;
}

// Vectors of sums the grouped loops below may keep in registers: 24 of AVX-512's 32. Built for AVX2 (16 registers)
// they ran 0.79-0.98x the plain ones in one paired run on the AVX-512 machine restricted to AVX2 code (register
// pairs, spills; that machine's noise was large, +-20%, but every row was below 1), so there they are off: AVX2 has
// loops of its own over 8-float vectors (AVX2_FMA below).
typedef v16f vacc;
#if defined(__AVX512F__)
constexpr int ACC_REGS = 24;
#else
constexpr int ACC_REGS = 0;
#endif
// AVX2 with FMA and no AVX-512: the loops below written for its sixteen 8-float registers (scores2_avx2,
// scores_lanes, values_pair and values_group over v8f)
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr bool AVX2_FMA = true;
#else
constexpr bool AVX2_FMA = false;
#endif

// scores4<v16f, T, 1>'s sums (16 lanes: lane l over d = l, l + 16, ..., reduced as hsum4(halves(.))) with each
// 16-lane vector written out as two AVX2 registers, two tokens at a time, the GS query heads of a kv head sharing each
// key vector (widened once for a float16 pool): the same bits. Built for AVX2, GCC had kept scores4's v16f values on
// the stack. Tokens 0..count/4*4-1, whose count it returns (scores4's; dot_tokens does the rest). With values_group
// over v8f (values_fast) the decode op ran 2.3-3x faster (one row after 1,000 / 4,000 tokens, 8 rows after 100 /
// 1,000; SmolLM2's heads, float16 pages; AMD EPYC Zen 3, 2 threads) and SmolLM2 int8's one-stream decode after 1,024
// tokens 1.3-1.5x (72-84 -> 94-118 tok/s, four alternating process pairs; session 53).
template <class T, int GS>
int64_t scores2_avx2(const float* qr, const T* kp, int64_t count, const Heads& hs, float* scores, int64_t m) {
  const int64_t n = count / 4 * 4;
  for (int64_t i = 0; i < n; i += 2) {
    if (i % 4 == 0 && i + AHEAD < count)
      prefetch_rows(kp + (i + AHEAD) * hs.HD, std::min<int64_t>(4, count - i - AHEAD) * hs.HD);
    for (int64_t j = 0; j < hs.Hkv; ++j) {
      const T* k0 = kp + i * hs.HD + j * hs.D;
      for (int64_t h0 = j * hs.G; h0 < (j + 1) * hs.G; h0 += GS) {
        v8f lo[GS][2], hi[GS][2];
        for (int g = 0; g < GS; ++g) lo[g][0] = lo[g][1] = hi[g][0] = hi[g][1] = v8f{};
        for (int64_t d = 0; d < hs.D; d += 16) {
          for (int t = 0; t < 2; ++t) {
            const v8f xl = load_vec<v8f>(k0 + t * hs.HD + d), xh = load_vec<v8f>(k0 + t * hs.HD + d + 8);
            for (int g = 0; g < GS; ++g) {
              const float* q = qr + (h0 + g) * hs.D + d;
              lo[g][t] += load_vec<v8f>(q) * xl;
              hi[g][t] += load_vec<v8f>(q + 8) * xh;
            }
          }
        }
        for (int g = 0; g < GS; g += 2) {  // two heads' two tokens a reduction
          const bool two = g + 1 < GS;
          const v4f s = hsum4(lo[g][0] + hi[g][0], lo[g][1] + hi[g][1], two ? lo[g + 1][0] + hi[g + 1][0] : v8f{},
                              two ? lo[g + 1][1] + hi[g + 1][1] : v8f{});
          scores[(h0 + g) * m + i] = s[0], scores[(h0 + g) * m + i + 1] = s[1];
          if (two) scores[(h0 + g + 1) * m + i] = s[2], scores[(h0 + g + 1) * m + i + 1] = s[3];
        }
      }
    }
  }
  return n;
}

// scores4 one query head at a time (a float32 cache: scores16 first), or for a float16 cache a whole group (1-4 heads)
// per key vector where its 4 G sums fit in registers (scores8h first where 8 G do): each key vector is then widened
// once for the group (1.15-1.4x the attention op at 64 and 128 dims); a float32 cache's loads cost little and the
// grouped loop ran 0.75-0.8x there (AMD EPYC AVX-512)
template <class V, class T>
int64_t scores4_fast(const float* qr, const T* kp, int64_t count, const Heads& hs, float* scores, int64_t m) {
  if constexpr (AVX2_FMA && sizeof(V) == 64) {  // 14 of 16 registers at GS = 3
    if (hs.G % 3 == 0) return scores2_avx2<T, 3>(qr, kp, count, hs, scores, m);
    if (hs.G % 2 == 0) return scores2_avx2<T, 2>(qr, kp, count, hs, scores, m);
    return scores2_avx2<T, 1>(qr, kp, count, hs, scores, m);
  }
  if constexpr (std::is_same_v<T, float> && sizeof(V) == 64) {
    int64_t i = -1;
    switch (ACC_REGS >= 16 ? hs.D / 16 : 0) {  // q's vectors and 16 sums in registers: 64 or 128 dims
      case 4: i = scores16<4>(qr, kp, count, hs, scores, m); break;
      case 8: i = scores16<8>(qr, kp, count, hs, scores, m); break;
      default: break;
    }
    if (i >= 0) return i + scores4<V, T, 1>(qr, kp + i * hs.HD, count - i, hs, scores + i, m);
  }
  int64_t done = 0;  // tokens scored eight at a time; the rest four at a time below
  if constexpr (std::is_same_v<T, half> && sizeof(V) == 64) {
    switch (hs.G * 8 <= ACC_REGS ? hs.G : 0) {
      case 1: done = scores8h<1>(qr, kp, count, hs, scores, m); break;
      case 2: done = scores8h<2>(qr, kp, count, hs, scores, m); break;
      case 3: done = scores8h<3>(qr, kp, count, hs, scores, m); break;
      default: break;
    }
    kp += done * hs.HD, scores += done, count -= done;
  }
  if (std::is_same_v<T, half> && hs.G * 4 <= ACC_REGS) {
    switch (hs.G) {
      case 2: return done + scores4<V, T, 2>(qr, kp, count, hs, scores, m);
      case 3: return done + scores4<V, T, 3>(qr, kp, count, hs, scores, m);
      case 4: return done + scores4<V, T, 4>(qr, kp, count, hs, scores, m);
      default: break;
    }
  }
  return done + scores4<V, T, 1>(qr, kp, count, hs, scores, m);
}

// the scores of a page run's tokens i..count-1 one at a time (`dot` for each head; row stride m): what the loops over
// 4, 8 or 16 tokens leave of a run (a multiple of 4 where the head size is a multiple of 8)
template <class T>
inline void dot_tokens(const float* qr, const T* kp, int64_t i, int64_t count, const Heads& hs, float* scores,
                       int64_t m) {
  for (; i < count; ++i)
    for (int64_t h = 0; h < hs.Hq; ++h)
      scores[h * m + i] = dot(qr + h * hs.D, kp + i * hs.HD + (h / hs.G) * hs.D, hs.D);
}

// scores[h * m + (t - t0)] = q_h . k_t for tokens t0..t1-1 (m = t1 - t0; q already scaled). Every head of a token
// is read in one pass over its row of the pool (reading one head of every token would stride through memory);
// four tokens at a time, eight lanes of d per step, the four sums reduced in registers (a head size not a multiple
// of 8 takes the plain loop).
template <class T>
void scores_of(const float* qr, const T* kf, const T* vf, const Pages& pg, int64_t t0, int64_t t1, const Heads& hs,
               float* scores) {
  const int64_t m = t1 - t0;
  pg.each(t0, t1, [&](int64_t t, int64_t count, int64_t slot, int64_t next_count, int64_t next_slot) {
    const T* kp = kf + slot * hs.HD;
    prefetch_rows(kf + next_slot * hs.HD, std::min(next_count, AHEAD) * hs.HD);
    prefetch_rows(vf + slot * hs.HD, count * hs.HD);  // the values pass's rows, on their way meanwhile
    int64_t i = 0;
    if (hs.D % 16 == 0) {
      i = scores4_fast<v16f>(qr, kp, count, hs, scores + (t - t0), m);
    } else if (hs.D % 8 == 0) {
      i = scores4_fast<v8f>(qr, kp, count, hs, scores + (t - t0), m);
    }
    dot_tokens(qr, kp, i, count, hs, scores + (t - t0), m);
  });
}

// Rows that read the same pages (a prompt chunk's tokens, one row each) score every chunk of keys with the same
// vectors: widened and transposed once per chunk (kv head j's dim d of token t0 + i at kt[(j * D + d) * W + i]), a
// row's scores then take tokens along the lanes, so no sum needs a horizontal reduction. W is a multiple of 16;
// columns past t1 - t0 are zero. 16 tokens by 16 dims at a time, transposed in registers: each of four rounds swaps
// one bit of the token index with the same bit of the dim index (rows x, y = x's with bit b set).
template <int b>
inline void swap_bit(v16f& x, v16f& y) {
  constexpr int s = 1 << b;
  v16f nx, ny;
  for (int j = 0; j < 16; ++j) {  // unrolled into two two-source shuffles per pair
    nx[j] = (j & s) ? y[j - s] : x[j];
    ny[j] = (j & s) ? y[j] : x[j + s];
  }
  x = nx, y = ny;
}

template <int b>
inline void swap_bits(v16f (&r)[16]) {
  for (int i = 0; i < 16; ++i)
    if (!(i & (1 << b))) swap_bit<b>(r[i], r[i | (1 << b)]);
}

template <class T>
void transpose_keys(const T* kf, const Pages& pg, int64_t t0, int64_t t1, const Heads& hs, float* kt, int64_t W) {
  const int64_t m = t1 - t0;
  std::vector<const T*> row(W);
  const std::vector<T> zero(hs.HD, T(0.f));
  pg.each(t0, t1, [&](int64_t t, int64_t count, int64_t slot, int64_t, int64_t) {
    for (int64_t i = 0; i < count; ++i) row[t - t0 + i] = kf + (slot + i) * hs.HD;
  });
  for (int64_t i = m; i < W; ++i) row[i] = zero.data();
  for (int64_t i = 0; i < m; i += 16) {
    for (int64_t e = 0; e < hs.HD; e += 16) {
      v16f r[16];
      for (int t = 0; t < 16; ++t) r[t] = load_vec<v16f>(row[i + t] + e);
      swap_bits<0>(r), swap_bits<1>(r), swap_bits<2>(r), swap_bits<3>(r);
      for (int d = 0; d < 16; ++d) std::memcpy(kt + (e + d) * W + i, &r[d], sizeof(v16f));
    }
  }
  for (int64_t e = 0; e < hs.HD; ++e) std::fill(kt + e * W + (m + 15) / 16 * 16, kt + (e + 1) * W, 0.f);
}

// scores_of (head size a multiple of 16) for GS query heads of one kv head and the L tokens i..i+L-1 of
// transpose_keys' kh (V: L floats, v16f with AVX-512, v8f with AVX2), with the same bits: the 16-lane loops (scores4
// / scores8h / scores16 / scores2_avx2 over 16-lane sums) sum lane l of a token's products over d = l, l + 16, ... in
// that order, then add the lanes in hsum4's order (l and l + 8, then l + 4, l + 2, l + 1). Here tokens are the lanes:
// lane l's sums are built as vectors in the same order and added as soon as their partner is done (C(l) = (l + l+8) +
// (l+4 + l+12), then (C(0) + C(2)) + (C(1) + C(3))), so at most two partial sums per head wait and each key vector
// loaded serves the GS heads: with v8f and GS = 3, 14 of AVX2's 16 registers (the last quarter spills three). AVX2,
// a 256-token chunk's attention after 768 tokens (one layer, SmolLM2's heads, float16 pages; AMD EPYC Zen 3, 2
// threads): 36 ms a row at a time, ~6-10 ms grouped, torch's SDPA 7-11 ms; the loop runs ~11 products a cycle (two
// FMAs a cycle: 16; an estimate from perf's share of the op at an assumed ~3.2 GHz).
template <class V, int GS, int ND>
inline void scores_lanes(const float* q, const float* kh, int64_t W, V (&out)[GS]) {
  constexpr int D = 16 * ND;
  // lanes `lane` and `lane` + 8 (B(lane))
  auto pair = [&](int lane, V (&b)[GS]) {
    V a0[GS], a8[GS];
#pragma GCC unroll 3
    for (int g = 0; g < GS; ++g) a0[g] = a8[g] = V{};
#pragma GCC unroll 8
    for (int c = 0; c < D; c += 16) {
      V k0 = load_vec<V>(kh + (c + lane) * W), k8 = load_vec<V>(kh + (c + lane + 8) * W);
      // held in registers for the GS heads (GCC otherwise folds a load into each product)
      if constexpr (sizeof(V) == 32) {
#if defined(__AVX__)
        asm("" : "+x"(k0), "+x"(k8));
#endif
      } else {
#if defined(__AVX512F__)  // (a 64-byte register operand needs AVX-512; without it v16f is not used here: ACC_REGS)
        asm("" : "+v"(k0), "+v"(k8));
#endif
      }
#pragma GCC unroll 3
      for (int g = 0; g < GS; ++g) {
        a0[g] += q[g * D + c + lane] * k0;
        a8[g] += q[g * D + c + lane + 8] * k8;
      }
    }
#pragma GCC unroll 3
    for (int g = 0; g < GS; ++g) b[g] = a0[g] + a8[g];
  };
  auto quad = [&](int l, V (&c)[GS]) {  // C(l)
    V b0[GS], b4[GS];
    pair(l, b0);
    pair(l + 4, b4);
#pragma GCC unroll 3
    for (int g = 0; g < GS; ++g) c[g] = b0[g] + b4[g];
  };
  V even[GS], x[GS], y[GS];
  quad(0, x);
  quad(2, y);
#pragma GCC unroll 3
  for (int g = 0; g < GS; ++g) even[g] = x[g] + y[g];
  quad(1, x);
  quad(3, y);
#pragma GCC unroll 3
  for (int g = 0; g < GS; ++g) out[g] = even[g] + (x[g] + y[g]);
}

// Rows k = 0..n-1 (queries qs[k], ms[k] tokens from t0, nondecreasing) scored from transpose_keys' kt into outs[k]
// ([Hq, ms[k]]), a block of 16 tokens at a time for every row, so that the block's key vectors (16 tokens' dims of
// one kv head: 64 lines for 64 dims) stay in L1 across the rows: a row at a time read each head's whole chunk of keys
// from L2 and ran no faster than scores8h. V: v16f (AVX-512) or v8f (AVX2: blocks of 8 tokens).
template <class V, int GS, int ND>
void scores_rows_gs(const float* const* qs, float* const* outs, const int64_t* ms, int64_t n, const float* kt,
                    int64_t W, const Heads& hs) {
  constexpr int64_t L = sizeof(V) / sizeof(float);
  const int64_t longest = ms[n - 1];
  for (int64_t h = 0; h < hs.Hq; h += GS) {
    const float* kh = kt + (h / hs.G) * hs.D * W;
    for (int64_t i = 0; i < longest; i += L) {
      for (int64_t k = 0; k < n; ++k) {
        const int64_t m = ms[k];
        if (i >= m) continue;
        V s[GS];
        scores_lanes<V, GS, ND>(qs[k] + h * hs.D, kh + i, W, s);
        if (m - i >= L) {
          for (int g = 0; g < GS; ++g) std::memcpy(outs[k] + (h + g) * m + i, &s[g], sizeof(V));
        } else {
          for (int g = 0; g < GS; ++g)
            for (int64_t t = 0; t < m - i; ++t) outs[k][(h + g) * m + i + t] = s[g][t];
        }
      }
    }
  }
}

// Whether a prompt chunk's rows are scored from transposed keys (Attention::group): with AVX-512 (16 tokens a vector,
// ACC_REGS) or AVX2 with FMA (eight)
constexpr bool ROW_GROUPS = ACC_REGS >= 16 || AVX2_FMA;

// head sizes transpose_keys' rows take: 16, 32, 64, 128
constexpr bool transposed_size(int64_t D) { return D == 16 || D == 32 || D == 64 || D == 128; }

template <int ND>
void scores_rows_nd(const float* const* qs, float* const* outs, const int64_t* ms, int64_t n, const float* kt,
                    int64_t W, const Heads& hs) {
  using V = std::conditional_t<ACC_REGS >= 16, v16f, v8f>;
  if (hs.G % 3 == 0) return scores_rows_gs<V, 3, ND>(qs, outs, ms, n, kt, W, hs);
  if (hs.G % 2 == 0) return scores_rows_gs<V, 2, ND>(qs, outs, ms, n, kt, W, hs);
  scores_rows_gs<V, 1, ND>(qs, outs, ms, n, kt, W, hs);
}

// scores_of's bits for every row but the tokens past a page run's last multiple of 4 (scores_of's `dot`: the caller
// rewrites those)
inline void scores_rows(const float* const* qs, float* const* outs, const int64_t* ms, int64_t n, const float* kt,
                        int64_t W, const Heads& hs) {
  switch (hs.D) {
    case 16: return scores_rows_nd<1>(qs, outs, ms, n, kt, W, hs);
    case 32: return scores_rows_nd<2>(qs, outs, ms, n, kt, W, hs);
    case 64: return scores_rows_nd<4>(qs, outs, ms, n, kt, W, hs);
    case 128: return scores_rows_nd<8>(qs, outs, ms, n, kt, W, hs);
    default: TORCH_CHECK(false, "scores_rows: head size ", hs.D);
  }
}

// the tokens scores_of gives `dot_tokens` (past each page run's last multiple of 4), as it computes them
template <class T>
void scores_tails(const float* qr, const T* kf, const Pages& pg, int64_t t0, int64_t t1, const Heads& hs,
                  float* scores) {
  pg.each(t0, t1, [&](int64_t t, int64_t count, int64_t slot, int64_t, int64_t) {
    dot_tokens(qr, kf + slot * hs.HD, count / 4 * 4, count, hs, scores + (t - t0), t1 - t0);
  });
}

// acc[h] = sum_t p[h * m + (t - t0)] v_t over tokens t0..t1-1, four tokens at a time (one load and store of acc per
// four tokens), every head of a token in one pass like scores_of.
template <class T>
void values_of(const float* p, const T* vf, const Pages& pg, int64_t t0, int64_t t1, const Heads& hs,
               float* acc) {
  const int64_t m = t1 - t0;
  std::fill(acc, acc + hs.Hq * hs.D, 0.f);
  pg.each(t0, t1, [&](int64_t t, int64_t count, int64_t slot, int64_t next_count, int64_t next_slot) {
    const T* vp = vf + slot * hs.HD;
    prefetch_rows(vf + next_slot * hs.HD, std::min(next_count, AHEAD) * hs.HD);
    int64_t i = 0;
    for (; i + 4 <= count; i += 4) {
      if (i + AHEAD < count) prefetch_rows(vp + (i + AHEAD) * hs.HD, std::min<int64_t>(4, count - i - AHEAD) * hs.HD);
      for (int64_t h = 0; h < hs.Hq; ++h) {
        const T *v0 = vp + i * hs.HD + (h / hs.G) * hs.D, *v1 = v0 + hs.HD, *v2 = v1 + hs.HD, *v3 = v2 + hs.HD;
        const float* ph = p + h * m + (t - t0) + i;
        const float p0 = ph[0], p1 = ph[1], p2 = ph[2], p3 = ph[3];
        float* __restrict a = acc + h * hs.D;
        if constexpr (std::is_same_v<T, half>) {  // GCC leaves a loop over halves scalar: widen 8 at a time
          for (int64_t d = 0; d < hs.D; d += 8) {
            const v8f sum = load_vec<v8f>(a + d) + p0 * load_vec<v8f>(v0 + d) + p1 * load_vec<v8f>(v1 + d) +
                            p2 * load_vec<v8f>(v2 + d) + p3 * load_vec<v8f>(v3 + d);
            std::memcpy(a + d, &sum, sizeof sum);
          }
        } else {
#pragma omp simd
          for (int64_t d = 0; d < hs.D; ++d) a[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
        }
      }
    }
    for (; i < count; ++i) {
      for (int64_t h = 0; h < hs.Hq; ++h) {
        const T* vt = vp + i * hs.HD + (h / hs.G) * hs.D;
        const float ph = p[h * m + (t - t0) + i];
        float* __restrict a = acc + h * hs.D;
#pragma omp simd
        for (int64_t d = 0; d < hs.D; ++d) a[d] += ph * static_cast<float>(vt[d]);
      }
    }
  });
}

// values_of for kv head j's G query heads and NC vectors of columns from c0: the G x NC sums stay in registers over
// all of the chunk's tokens and each value vector is loaded once for the G heads. Every sum takes its tokens in the
// order and grouping values_of gives them: the same bits.
template <class V, class T, int G, int NC>
void values_group(const float* p, const T* vf, const Pages& pg, int64_t t0, int64_t t1, const Heads& hs, int64_t j,
                  int64_t c0, float* acc) {
  const int64_t m = t1 - t0;
  constexpr int64_t L = sizeof(V) / sizeof(float);
  V a[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = V{};
  pg.each(t0, t1, [&](int64_t t, int64_t count, int64_t slot, int64_t next_count, int64_t next_slot) {
    const T* vp = vf + slot * hs.HD + j * hs.D + c0;
    const bool first = j == 0 && c0 == 0;  // the first pass over the tokens brings every head's rows in for the others
    if (first) prefetch_rows(vf + next_slot * hs.HD, std::min(next_count, AHEAD) * hs.HD);
    const float* pt = p + j * G * m + (t - t0);
    int64_t i = 0;
    if constexpr (std::is_same_v<T, float>) {  // values_of's float32 order: four tokens' products summed, then added
      for (; i + 4 <= count; i += 4) {
        if (first && i + AHEAD < count)
          prefetch_rows(vp - j * hs.D + (i + AHEAD) * hs.HD, std::min<int64_t>(4, count - i - AHEAD) * hs.HD);
        for (int c = 0; c < NC; ++c) {
          const float* v0 = vp + i * hs.HD + c * L;
          const V x0 = load_vec<V>(v0), x1 = load_vec<V>(v0 + hs.HD), x2 = load_vec<V>(v0 + 2 * hs.HD),
                  x3 = load_vec<V>(v0 + 3 * hs.HD);
          for (int g = 0; g < G; ++g) {
            const float* w = pt + g * m + i;
            a[g][c] += w[0] * x0 + w[1] * x1 + w[2] * x2 + w[3] * x3;
          }
        }
      }
    }
    for (; i < count; ++i) {
      if (first && i % 4 == 0 && i + AHEAD < count)
        prefetch_rows(vp - j * hs.D + (i + AHEAD) * hs.HD, std::min<int64_t>(4, count - i - AHEAD) * hs.HD);
      V v[NC];
      for (int c = 0; c < NC; ++c) v[c] = load_vec<V>(vp + i * hs.HD + c * L);
      for (int g = 0; g < G; ++g) {
        const float w = pt[g * m + i];
        for (int c = 0; c < NC; ++c) a[g][c] = a[g][c] + w * v[c];
      }
    }
  });
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) std::memcpy(acc + (j * G + g) * hs.D + c0 + c * L, &a[g][c], sizeof(V));
}

template <class V, class T, int G, int NC>
void values_heads(const float* p, const T* vf, const Pages& pg, int64_t t0, int64_t t1, const Heads& hs, float* acc) {
  constexpr int64_t L = sizeof(V) / sizeof(float);
  for (int64_t j = 0; j < hs.Hkv; ++j)
    for (int64_t c0 = 0; c0 < hs.D; c0 += NC * L) values_group<V, T, G, NC>(p, vf, pg, t0, t1, hs, j, c0, acc);
}

// values_group's sums (float16 pools) for two rows that read the same pages, the second at least as long (ma <= mb
// tokens from t0): each value vector is widened once for both rows, which halves the loads and conversions of a
// prompt chunk's rows. Each sum takes its tokens in values_group's order: the same bits (a value's sums are lane by
// lane, so V's width does not change them: vacc with AVX-512, v8f with AVX2).
template <class V, int G, int NC>
void values_pair(const float* pa, int64_t ma, const float* pb, int64_t mb, const half* vf, const Pages& pg, int64_t t0,
                 const Heads& hs, int64_t j, int64_t c0, float* acca, float* accb) {
  constexpr int64_t L = sizeof(V) / sizeof(float);
  V a[G][NC], b[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = b[g][c] = V{};
  pg.each(t0, t0 + mb, [&](int64_t t, int64_t count, int64_t slot, int64_t, int64_t) {
    const half* vp = vf + slot * hs.HD + j * hs.D + c0;
    const float *wa = pa + j * G * ma + (t - t0), *wb = pb + j * G * mb + (t - t0);
    const int64_t both = std::clamp<int64_t>(t0 + ma - t, 0, count);
    int64_t i = 0;
    for (; i < both; ++i) {
      V v[NC];
      for (int c = 0; c < NC; ++c) v[c] = load_vec<V>(vp + i * hs.HD + c * L);
      for (int g = 0; g < G; ++g) {
        const float x = wa[g * ma + i], y = wb[g * mb + i];
        for (int c = 0; c < NC; ++c) {
          a[g][c] = a[g][c] + x * v[c];
          b[g][c] = b[g][c] + y * v[c];
        }
      }
    }
    for (; i < count; ++i) {
      V v[NC];
      for (int c = 0; c < NC; ++c) v[c] = load_vec<V>(vp + i * hs.HD + c * L);
      for (int g = 0; g < G; ++g) {
        const float y = wb[g * mb + i];
        for (int c = 0; c < NC; ++c) b[g][c] = b[g][c] + y * v[c];
      }
    }
  });
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NC; ++c) {
      std::memcpy(acca + (j * G + g) * hs.D + c0 + c * L, &a[g][c], sizeof(V));
      std::memcpy(accb + (j * G + g) * hs.D + c0 + c * L, &b[g][c], sizeof(V));
    }
  }
}

template <class V, int G, int NC>
void values_pair_heads(const float* pa, int64_t ma, const float* pb, int64_t mb, const half* vf, const Pages& pg,
                       int64_t t0, const Heads& hs, float* acca, float* accb) {
  for (int64_t j = 0; j < hs.Hkv; ++j)
    for (int64_t c0 = 0; c0 < hs.D; c0 += NC * static_cast<int64_t>(sizeof(V) / sizeof(float)))
      values_pair<V, G, NC>(pa, ma, pb, mb, vf, pg, t0, hs, j, c0, acca, accb);
}

// The grouped value loops' sums: vacc in AVX-512's registers (ACC_REGS of them), v8f in AVX2's 16; none without
using VSum = std::conditional_t<(ACC_REGS > 0), vacc, v8f>;
constexpr bool SUM_LOOPS = ACC_REGS > 0 || AVX2_FMA;

// whether `sums` vectors of sums fit in registers beside `others` vectors (values, weights: counted on AVX2 only)
constexpr bool fit(int64_t sums, int64_t others) { return ACC_REGS > 0 ? sums <= ACC_REGS : sums + others <= 16; }

// the widest power of two up to `most` that divides n and for which ok(nc)
template <class F>
int widest(int64_t n, int most, const F& ok) {
  int nc = most;
  while (nc > 1 && (n % nc || !ok(nc))) nc /= 2;
  return nc;
}

// values_pair for these heads, or null where their sums do not fit in registers twice (values_fast then, a row at a
// time): 2 G nc sums, beside nc value vectors and two weights
using PairFn = void (*)(const float*, int64_t, const float*, int64_t, const half*, const Pages&, int64_t, const Heads&,
                        float*, float*);
inline PairFn values_pair_fn(const Heads& hs) {
  constexpr int64_t L = sizeof(VSum) / sizeof(float);
  if (!SUM_LOOPS || hs.D % L != 0 || hs.G > 3) return nullptr;
  const int nc = widest(hs.D / L, 4, [&](int64_t c) { return fit(2 * hs.G * c, c + 2); });
  static constexpr PairFn table[3][3] = {
      {values_pair_heads<VSum, 1, 1>, values_pair_heads<VSum, 1, 2>, values_pair_heads<VSum, 1, 4>},
      {values_pair_heads<VSum, 2, 1>, values_pair_heads<VSum, 2, 2>, values_pair_heads<VSum, 2, 4>},
      {values_pair_heads<VSum, 3, 1>, values_pair_heads<VSum, 3, 2>, values_pair_heads<VSum, 3, 4>}};
  return table[hs.G - 1][std::countr_zero(static_cast<unsigned>(nc))];
}

// values_of with each kv head's sums in registers where the head size and group allow (query heads per kv head 1-4,
// head size a multiple of the vector width): a float32 cache's value vectors are then loaded once per group, not
// once per query head, and the sums are not loaded and stored every four tokens. G nc sums, beside nc value vectors
// (four rows of them for float32) and four weights.
template <class T>
void values_fast(const float* p, const T* vf, const Pages& pg, int64_t t0, int64_t t1, const Heads& hs, float* acc) {
  using Fn = void (*)(const float*, const T*, const Pages&, int64_t, int64_t, const Heads&, float*);
  constexpr int64_t L = sizeof(VSum) / sizeof(float), ROWS = std::is_same_v<T, float> ? 4 : 1;
  if (SUM_LOOPS && hs.D % L == 0 && hs.G <= 4) {
    const int nc = widest(hs.D / L, 8, [&](int64_t c) { return fit(hs.G * c, ROWS * c + 4); });
    static constexpr Fn table[4][4] = {
        {values_heads<VSum, T, 1, 1>, values_heads<VSum, T, 1, 2>, values_heads<VSum, T, 1, 4>,
         values_heads<VSum, T, 1, 8>},
        {values_heads<VSum, T, 2, 1>, values_heads<VSum, T, 2, 2>, values_heads<VSum, T, 2, 4>,
         values_heads<VSum, T, 2, 8>},
        {values_heads<VSum, T, 3, 1>, values_heads<VSum, T, 3, 2>, values_heads<VSum, T, 3, 4>,
         values_heads<VSum, T, 3, 8>},
        {values_heads<VSum, T, 4, 1>, values_heads<VSum, T, 4, 2>, values_heads<VSum, T, 4, 4>,
         values_heads<VSum, T, 4, 8>}};
    return table[hs.G - 1][std::countr_zero(static_cast<unsigned>(nc))](p, vf, pg, t0, t1, hs, acc);
  }
  values_of(p, vf, pg, t0, t1, hs, acc);
}

// per head h: max[h] = max_t s, s = exp(s - max[h]) in place, sum[h] = sum_t s (unnormalized: chunks merge later).
// The max and the sum in 16 lanes by hand: GCC's own reductions over a few dozen scores went through the stack
// (a store-to-load stall per head: ~11% of a batch-8 short-context call).
void exp_rows(float* scores, int64_t H, int64_t m, float* max, float* sum) {
  for (int64_t h = 0; h < H; ++h) {
    float* sh = scores + h * m;
    const int64_t m16 = m / 16 * 16;
    float mx = sh[0];
    if (m16 > 0) {  // 16 lanes as two v8f: AVX2 kept a v16f's lanes on the stack (store-to-load stalls)
      v8f lo = load_vec<v8f>(sh), hi = load_vec<v8f>(sh + 8);
      for (int64_t t = 16; t < m16; t += 16) {
        const v8f x = load_vec<v8f>(sh + t), y = load_vec<v8f>(sh + t + 8);
        lo = x > lo ? x : lo;
        hi = y > hi ? y : hi;
      }
      for (int i = 0; i < 8; ++i) mx = lo[i] > mx ? lo[i] : mx;
      for (int i = 0; i < 8; ++i) mx = hi[i] > mx ? hi[i] : mx;
    }
    for (int64_t t = m16; t < m; ++t) mx = sh[t] > mx ? sh[t] : mx;
#pragma omp simd
    for (int64_t t = 0; t < m; ++t) sh[t] = exp_approx(sh[t] - mx);
    v8f lo = {}, hi = {};
    for (int64_t t = 0; t < m16; t += 16) lo += load_vec<v8f>(sh + t), hi += load_vec<v8f>(sh + t + 8);
    const v8f s8 = lo + hi;
    const v4f s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    float total = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    for (int64_t t = m16; t < m; ++t) total += sh[t];
    max[h] = mx, sum[h] = total;
  }
}

// [B, H, D] or [B, 1, H, D] with each row's heads contiguous: the row stride
int64_t row_stride(const at::Tensor& t, int64_t H, int64_t D, const char* name) {
  const bool ok = t.scalar_type() == at::kFloat && t.device().is_cpu() && t.size(-1) == D && t.size(-2) == H &&
                  t.stride(-1) == 1 && t.stride(-2) == D && (t.dim() == 3 || (t.dim() == 4 && t.size(1) == 1));
  TORCH_CHECK(ok, name, " must be a CPU float32 [B, H, D] or [B, 1, H, D] tensor with contiguous heads");
  return t.stride(0);
}

// A rope_attend call's operands, checked
struct Problem {
  const float *pq, *pk, *pv, *pc, *ps;
  const int64_t *pt, *pl;
  float* po;
  int64_t B, Hq, Hkv, D, R, P, sq, sk, sv, page_tokens;
  float fscale;
};

// the new token's key and value into their slots, as T
template <class T>
inline void store_token(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)  // round to nearest even, as torch's .half()
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

// A rope_attend call's work in three phases over rows and items, so that both torch's pool (attend) and the
// one-region Llama layers' threads (layer_phases) can run them: the same functions, so the same bits.
// Work items are (row, token chunk): a chunk's scores, softmax numerators and weighted values for every head, merged
// per row afterwards (flash-decoding). The chunk size is fixed, so a row's result does not depend on the batch it
// is in or on the thread count (and the dense cache, one page per row, splits it the same way).
template <class T>
struct Attention {
  const Problem& pr;
  T *kf, *vf;
  Heads hs;
  std::vector<int64_t> first;  // row b's items are first[b] .. first[b + 1] - 1
  int64_t items = 0, tokens = 0;
  std::unique_ptr<float[]> own;
  float *acc, *max, *sum;
  std::vector<float> qr;  // RoPE'd, scaled queries [B, Hq, D]

  // `shared`: another Attention's acc for the same rows and lengths (the same items), used instead of a buffer of
  // its own (`llama_layers_quant`: one for every layer of a step, where beyond 32 MB each would have had its own)
  Attention(const Problem& p, T* k, T* v, float* shared = nullptr)
      : pr(p), kf(k), vf(v), hs{p.Hq, p.Hkv, p.Hq / p.Hkv, p.D, p.Hkv * p.D}, first(p.B + 1, 0), qr(p.B * p.Hq * p.D) {
    for (int64_t b = 0; b < pr.B; ++b) {
      tokens += pr.pl[b] + 1;
      first[b + 1] = first[b] + (pr.pl[b] + CHUNK) / CHUNK;
    }
    items = first[pr.B];
    // every item writes its own acc, max and sum in full, so they need no zeroing: a buffer kept for the calling
    // thread (up to 32 MB; beyond, one of the call's own). A prefill chunk's tokens as rows needed ~28 MB of it a
    // layer at 4k tokens, zeroed (and faulted in) afresh per call before.
    thread_local std::vector<float> scratch;
    const size_t need = static_cast<size_t>(items) * pr.Hq * (pr.D + 2);
    if (shared) {
      acc = shared;
    } else if (need <= (size_t(32) << 20) / sizeof(float)) {
      if (scratch.size() < need) scratch.resize(need);
      acc = scratch.data();
    } else {
      own.reset(new float[need]);
      acc = own.get();
    }
    max = acc + items * pr.Hq * pr.D, sum = max + items * pr.Hq;
  }

  // rows b0..b1-1: the new token's key and value into their slots (each item reads every token of its row and head,
  // so this phase ends before the next begins), the queries RoPE'd and scaled
  __attribute__((noinline)) void rows(int64_t b0, int64_t b1) {
    const int64_t D = pr.D, R = pr.R;
    std::vector<float> key(hs.HD);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t slot = Pages{pr.pt + b * pr.P, pr.page_tokens}.slot(pr.pl[b]);
      for (int64_t j = 0; j < pr.Hkv; ++j) rope(pr.pk + b * pr.sk + j * D, pr.pc + b * R, pr.ps + b * R, key.data() + j * D, D, R, 1.f);
      store_token(key.data(), kf + slot * hs.HD, hs.HD);
      store_token(pr.pv + b * pr.sv, vf + slot * hs.HD, hs.HD);
      for (int64_t h = 0; h < pr.Hq; ++h) rope(pr.pq + b * pr.sq + h * D, pr.pc + b * R, pr.ps + b * R, qr.data() + (b * pr.Hq + h) * D, D, R, pr.fscale);
    }
  }

  // item i (row b's chunk i - first[b]) on its own
  void item(int64_t i, int64_t b, std::vector<float>& scores) {
    const int64_t t0 = (i - first[b]) * CHUNK, t1 = std::min(pr.pl[b] + 1, t0 + CHUNK);
    const Pages pg{pr.pt + b * pr.P, pr.page_tokens};
    // a row that shares its first page with the row before (a prompt chunk's tokens, forks of one sequence)
    // finds those rows in cache: read them once more and a prefill chunk ran 0.82-0.89x. A float16 pool's
    // arithmetic (widening every value) outweighs its reads: decode after 8,000 tokens 0.93x and 1.00x with it
    if (std::is_same_v<T, float> && (b == 0 || pr.pt[b * pr.P] != pr.pt[(b - 1) * pr.P]))
      touch(kf, vf, pg, t0, t1, hs);
    scores.resize(pr.Hq * (t1 - t0));
    scores_of(qr.data() + b * pr.Hq * pr.D, kf, vf, pg, t0, t1, hs, scores.data());
    exp_rows(scores.data(), pr.Hq, t1 - t0, max + i * pr.Hq, sum + i * pr.Hq);
    values_fast(scores.data(), vf, pg, t0, t1, hs, acc + i * pr.Hq * pr.D);
  }

  // whether row r reads the pages row r - 1 reads, and at least as many (a prompt chunk's rows)
  bool follows(int64_t r) const {
    if (pr.pl[r] < pr.pl[r - 1]) return false;
    const int64_t pages = (pr.pl[r - 1] + pr.page_tokens) / pr.page_tokens;
    return std::equal(pr.pt + (r - 1) * pr.P, pr.pt + (r - 1) * pr.P + pages, pr.pt + r * pr.P);
  }

  // Items i0..i1-1 of rows b..e-1 (rows that `follow`: a prompt chunk's tokens) a chunk of keys at a time: where at
  // least GROUP_ROWS rows have the chunk, its keys are widened and transposed once (transpose_keys), every row's
  // scores are taken from them (scores_rows) and a float16 pool's values are summed two rows at a time (values_pair);
  // elsewhere each item is done as `item`. The same bits as `item`.
  // With fewer, the transposition cost about what it saved (2 threads; AVX-512, and AVX2 once its rows alone ran
  // scores2_avx2: after 768 tokens 4-8 rows ran 0.45-0.77x grouped, 16 level, 256 1.3-1.8x; AMD EPYC Zen 3, session 53)
  static constexpr int64_t GROUP_ROWS = 16;
  void group(int64_t b, int64_t e, int64_t i0, int64_t i1, std::vector<float>& scores) {
    thread_local std::vector<float> kt, all;  // the chunk's keys transposed; its rows' scores
    thread_local std::vector<int64_t> rows, ms;
    thread_local std::vector<const float*> qs;
    thread_local std::vector<float*> outs;
    // kt's rows 576 bytes apart: at 512 (a power of two) a block's 64 rows share few L1 sets; the op at 4,000
    // tokens 20.2 vs 21.4 ms (medians of 8 alternations, noisy; AMD EPYC Zen 4)
    constexpr int64_t W = CHUNK + 16;
    kt.resize(pr.Hkv * pr.D * W);
    for (int64_t c = 0; c < (pr.pl[e - 1] + CHUNK) / CHUNK; ++c) {
      const int64_t t0 = c * CHUNK;
      rows.clear(), ms.clear(), qs.clear(), outs.clear();
      for (int64_t r = b; r < e; ++r) {
        const int64_t i = first[r] + c;
        if (i < i0 || i >= i1 || i >= first[r + 1]) continue;
        rows.push_back(r);
        ms.push_back(std::min(pr.pl[r] + 1, t0 + CHUNK) - t0);
        qs.push_back(qr.data() + r * pr.Hq * pr.D);
      }
      const int64_t n = rows.size();
      if (n < GROUP_ROWS) {
        for (const int64_t r : rows) item(first[r] + c, r, scores);
        continue;
      }
      const Pages pg{pr.pt + rows[n - 1] * pr.P, pr.page_tokens};  // the longest row's: every row's
      transpose_keys(kf, pg, t0, t0 + ms[n - 1], hs, kt.data(), W);
      all.resize(n * pr.Hq * CHUNK);
      for (int64_t k = 0; k < n; ++k) outs.push_back(all.data() + k * pr.Hq * CHUNK);
      scores_rows(qs.data(), outs.data(), ms.data(), n, kt.data(), W, hs);
      for (int64_t k = 0; k < n; ++k) {
        const int64_t i = first[rows[k]] + c;
        scores_tails(qs[k], kf, pg, t0, t0 + ms[k], hs, outs[k]);
        exp_rows(outs[k], pr.Hq, ms[k], max + i * pr.Hq, sum + i * pr.Hq);
      }
      PairFn pair = nullptr;
      if constexpr (std::is_same_v<T, half>) pair = values_pair_fn(hs);
      for (int64_t k = 0; k < n; ++k) {
        float* out = acc + (first[rows[k]] + c) * pr.Hq * pr.D;
        if constexpr (std::is_same_v<T, half>) {
          if (pair && k + 1 < n) {
            float* next = acc + (first[rows[k + 1]] + c) * pr.Hq * pr.D;
            pair(outs[k], ms[k], outs[k + 1], ms[k + 1], vf, pg, t0, hs, out, next);
            ++k;
            continue;
          }
        }
        values_fast(outs[k], vf, pg, t0, t0 + ms[k], hs, out);
      }
    }
  }

  __attribute__((noinline)) void work(int64_t i0, int64_t i1) {
    std::vector<float> scores;
    // scores_lanes (16 tokens a vector with AVX-512, 8 with AVX2) in the 16-lane loops' order (head sizes of 16k)
    const bool transposed = ROW_GROUPS && transposed_size(pr.D);
    for (int64_t i = i0; i < i1;) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
      int64_t e = b + 1;
      if (transposed)
        while (e < pr.B && first[e] < i1 && follows(e)) ++e;
      if (e - b >= GROUP_ROWS) {
        group(b, e, i, i1, scores);
        i = std::min(i1, first[e]);
        continue;
      }
      for (int64_t r = b; r < e; ++r)
        for (; i < std::min(i1, first[r + 1]); ++i) item(i, r, scores);
    }
  }

  // each row's chunks merged: rescaled to the largest max, divided by the total
  __attribute__((noinline)) void merge(int64_t b0, int64_t b1) {
    const int64_t Hq = pr.Hq, D = pr.D;
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t h = 0; h < Hq; ++h) {
        float mx = max[first[b] * Hq + h];
        for (int64_t i = first[b] + 1; i < first[b + 1]; ++i) mx = max[i * Hq + h] > mx ? max[i * Hq + h] : mx;
        float total = 0.f;
        float* o = pr.po + (b * Hq + h) * D;
        std::fill(o, o + D, 0.f);
        for (int64_t i = first[b]; i < first[b + 1]; ++i) {
          const float w = std::exp(max[i * Hq + h] - mx);
          total += w * sum[i * Hq + h];
          const float* a = acc + (i * Hq + h) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  }
};

template <class T>
void attend(const Problem& pr, T* kf, T* vf) {
  Attention<T> a(pr, kf, vf);
  a.rows(0, pr.B);
  // threads only for enough work: waking them costs more than a short cache's attention
  const int64_t grain = a.tokens * pr.Hq * pr.D < (1 << 16) ? a.items : 1;
  at::parallel_for(0, a.items, grain, [&](int64_t i0, int64_t i1) { a.work(i0, i1); });
  // rows apart (a prefill chunk's tokens are rows)
  const int64_t B = pr.B;
  at::parallel_for(0, B, B * pr.Hq * pr.D * (a.items / B + 1) < (1 << 16) ? B : 1,
                   [&](int64_t b0, int64_t b1) { a.merge(b0, b1); });
}

// rope_attend's operands, checked, with `out` (q's shape) as the output
Problem problem_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& kflat, const at::Tensor& vflat, const at::Tensor& table,
                   const at::Tensor& lengths, int64_t page_tokens, double scale, const at::Tensor& out) {
  TORCH_CHECK(q.dim() >= 3 && k.dim() >= 3, "q and k must be [B, H, D] or [B, 1, H, D]");
  const int64_t B = q.size(0), Hq = q.size(-2), D = q.size(-1), Hkv = k.size(-2), R = cos.size(-1);
  const int64_t sq = row_stride(q, Hq, D, "q"), sk = row_stride(k, Hkv, D, "k"), sv = row_stride(v, Hkv, D, "v");
  TORCH_CHECK(k.size(0) == B && v.size(0) == B, "q, k and v must have the same rows");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.numel() == B * R && sin.numel() == B * R && R % 2 == 0 &&
                  R <= D,
              "cos and sin must be contiguous float32 [B, R] (or [B, 1, 1, R]) with R even and at most D");
  const bool f16 = kflat.scalar_type() == at::kHalf;
  for (const at::Tensor* t : {&kflat, &vflat}) {
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) &&
                    t->scalar_type() == kflat.scalar_type() && t->is_contiguous() && t->dim() == 3 &&
                    t->size(1) == Hkv && t->size(2) == D,
                "the KV pools must be contiguous [slots, Hkv, D], both float32 or both float16");
  }
  TORCH_CHECK(!f16 || D % 8 == 0, "float16 KV pools need a head size that is a multiple of 8");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous() && table.dim() == 2 && table.size(0) == B,
              "table must be int64 [B, pages]");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == B,
              "lengths must be int64 [B]");
  TORCH_CHECK(page_tokens > 0, "page_tokens must be positive");
  const int64_t P = table.size(1), S = kflat.size(0);
  TORCH_CHECK(vflat.size(0) == S, "the key and value pools must have the same slots");
  const int64_t* pt = table.data_ptr<int64_t>();
  const int64_t* pl = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = pl[b] + 1;
    TORCH_CHECK(pl[b] >= 0 && (n + page_tokens - 1) / page_tokens <= P, "row ", b, ": ", n,
                " tokens do not fit its page table");
    for (int64_t p = 0; p < (n + page_tokens - 1) / page_tokens; ++p) {
      TORCH_CHECK(pt[b * P + p] >= 0 && (pt[b * P + p] + 1) * page_tokens <= S, "row ", b, ": page ", pt[b * P + p],
                  " is outside the pool");
    }
  }
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.numel() == B * Hq * D, "out must be [B, Hq, D]");
  return Problem{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), cos.data_ptr<float>(),
                 sin.data_ptr<float>(), pt, pl, out.data_ptr<float>(), B, Hq, Hkv, D, R, P, sq, sk, sv, page_tokens,
                 static_cast<float>(scale)};
}

at::Tensor rope_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& kflat, const at::Tensor& vflat,
                       const at::Tensor& table, const at::Tensor& lengths, int64_t page_tokens, double scale) {
  at::Tensor out = at::empty(q.sizes(), q.options());  // problem_of checks q's shape (and this) before any read
  const Problem pr = problem_of(q, k, v, cos, sin, kflat, vflat, table, lengths, page_tokens, scale, out);
  if (kflat.scalar_type() == at::kHalf) {
    attend(pr, kflat.data_ptr<half>(), vflat.data_ptr<half>());
  } else {
    attend(pr, kflat.data_ptr<float>(), vflat.data_ptr<float>());
  }
  return out;
}

// One row's token, as the sampler's torch path picks it (apply_penalties, filtered_probs, then draw), to rounding:
// with `seen` (tokens of the state, prompt or output [V] bool), a seen logit divided by `repetition` when positive,
// else multiplied by it; then with `counts` (the output's token counts [V] float), logits - frequency * count -
// presence * (count > 0) (vLLM's order); then / temperature; with 0 < top_k < V, values below the k-th largest
// dropped (ties with it kept); the softmax's numerators exp(y - max) (0 below max - 87, whose probability is under
// 2e-38, and for -inf); with min_p > 0, tokens under min_p times the most likely one's probability dropped; with
// top_p < 1, the smallest set of the most likely tokens left whose probabilities reach top_p (a token is kept when the
// ones before it sum to less than top_p, as vLLM cuts); then the first token whose running sum (in index order,
// double) passes u times the total. Only top_p sorts, and only the tokens that can be kept: a token of probability p
// with p * V < 1 - top_p never is (the tokens from it on, each at most p, would have to hold 1 - top_p), so those
// under half that bound are dropped unsorted; past 2,048 candidates (a flat distribution) their sums by value bucket
// (1/8 octave) find the bucket where p is reached, and only that bucket is sorted. -1 when the total is not finite
// and positive.
// One thread: ~V floats three or four times (the torch path took 0.2-0.5 ms a row of 49k in ~15 ops).
int64_t sample(const at::Tensor& logits, double temperature, int64_t top_k, double top_p, double min_p, double u,
               const std::optional<at::Tensor>& counts, const std::optional<at::Tensor>& seen, double frequency,
               double presence, double repetition) {
  TORCH_CHECK(logits.dim() == 1 && logits.is_contiguous() && logits.scalar_type() == at::kFloat && logits.is_cpu(),
              "logits must be a contiguous CPU float32 [V]");
  TORCH_CHECK(temperature > 0, "temperature must be > 0");
  const int64_t V = logits.size(0);
  TORCH_CHECK(V > 0, "logits must have at least one value");
  const float* x = logits.data_ptr<float>();
  const float t = static_cast<float>(temperature);
  std::vector<float> e(x, x + V);
  if (seen) {
    TORCH_CHECK(seen->sizes() == logits.sizes() && seen->is_contiguous() && seen->scalar_type() == at::kBool,
                "seen must be a contiguous bool [V]");
    const bool* m = seen->data_ptr<bool>();
    const float r = static_cast<float>(repetition);
    for (int64_t v = 0; v < V; ++v) e[v] = m[v] ? (e[v] > 0.f ? e[v] / r : e[v] * r) : e[v];
  }
  if (counts) {
    TORCH_CHECK(counts->sizes() == logits.sizes() && counts->is_contiguous() && counts->scalar_type() == at::kFloat,
                "counts must be a contiguous float32 [V]");
    const float* c = counts->data_ptr<float>();
    const float f = static_cast<float>(frequency), pr = static_cast<float>(presence);
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) e[v] = (e[v] - f * c[v]) - pr * (c[v] > 0.f ? 1.f : 0.f);
  }
  float mx = -INFINITY, bad = 0.f;
#pragma omp simd reduction(max : mx) reduction(+ : bad)
  for (int64_t v = 0; v < V; ++v) {
    const float y = e[v] / t;
    e[v] = y;
    mx = y > mx ? y : mx;
    bad += (y != y || y == INFINITY) ? 1.f : 0.f;
  }
  if (bad > 0.f || !(mx > -INFINITY)) return -1;
  float kth = -INFINITY;
  if (top_k > 0 && top_k < V) {  // a min-heap of the k largest: after the first k, most values lose one comparison
    std::vector<float> heap(e.begin(), e.begin() + top_k);
    std::make_heap(heap.begin(), heap.end(), std::greater<float>());
    for (int64_t v = top_k; v < V; ++v) {
      if (e[v] > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
        heap.back() = e[v];
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      }
    }
    kth = heap.front();
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t v = 0; v < V; ++v) {
    const float d = e[v] - mx;
    e[v] = (e[v] < kth || d < -87.f) ? 0.f : wkvm::exp_approx(d);
    sum += e[v];
  }
  if (!(sum > 0.f) || !std::isfinite(sum)) return -1;
  if (min_p > 0.0) {  // before top_p, which then measures what min_p leaves (vLLM's order); the most likely token's
    // numerator is exp(0)
    const float cut = static_cast<float>(min_p) * wkvm::exp_approx(0.f);
    float left = 0.f;
#pragma omp simd reduction(+ : left)
    for (int64_t v = 0; v < V; ++v) {
      e[v] = e[v] < cut ? 0.f : e[v];
      left += e[v];
    }
    sum = left;
  }
  if (top_p < 1.0) {
    const float floor_p = static_cast<float>(0.5 * (1.0 - top_p) / static_cast<double>(V)) * sum;
    std::vector<std::pair<float, int64_t>> kept;
    for (int64_t v = 0; v < V; ++v) {
      if (e[v] >= floor_p && e[v] > 0.f) {
        kept.emplace_back(e[v], v);
      } else {
        e[v] = 0.f;
      }
    }
    const double limit = top_p * static_cast<double>(sum);
    double before = 0.0;  // the kept candidates' sum so far, most likely first
    if (kept.size() > 2048) {  // a flat distribution: bucket by value first, then sort only the bucket that reaches p
      // a positive float's bits >> 20 (sign, exponent, 3 mantissa bits) order the buckets as their values
      std::vector<double> bucket_sum(1 << 11, 0.0);
      const auto bucket = [](float p) { return static_cast<int>(std::bit_cast<uint32_t>(p) >> 20); };
      for (const auto& [p, v] : kept) bucket_sum[bucket(p)] += p;
      int cut = -1;  // the bucket where the running sum from the top passes the limit
      for (int b = static_cast<int>(bucket_sum.size()) - 1; b >= 0; --b) {
        if (before + bucket_sum[b] >= limit) {
          cut = b;
          break;
        }
        before += bucket_sum[b];
      }
      if (cut < 0) {  // all of them sum to at most p (to rounding): every candidate stays
        kept.clear();
      } else {  // buckets above the cut stay whole, those below go; the cut's own tokens are sorted below
        std::vector<std::pair<float, int64_t>> edge;
        for (const auto& [p, v] : kept) {
          const int b = bucket(p);
          if (b < cut) {
            e[v] = 0.f;
          } else if (b == cut) {
            edge.emplace_back(p, v);
          }
        }
        kept.swap(edge);
      }
    }
    std::sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    for (const auto& [p, v] : kept) {
      if (before >= limit) e[v] = 0.f;  // kept while the ones before it sum to less than p (vLLM's cut)
      before += p;
    }
  }
  constexpr int64_t BLOCK = 256;  // block sums first, then the walk inside one block
  const int64_t nb = (V + BLOCK - 1) / BLOCK;
  std::vector<double> blocks(nb);
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    float part = 0.f;
    const int64_t v1 = std::min(V, (b + 1) * BLOCK);
#pragma omp simd reduction(+ : part)
    for (int64_t v = b * BLOCK; v < v1; ++v) part += e[v];
    blocks[b] = part;
    total += part;
  }
  if (!(total > 0.0) || !std::isfinite(total)) return -1;
  const double target = u * total;
  double run = 0.0;
  int64_t last = -1;
  for (int64_t b = 0; b < nb; ++b) {
    if (blocks[b] > 0.0) {
      if (run + blocks[b] > target) {
        for (int64_t v = b * BLOCK; v < std::min(V, (b + 1) * BLOCK); ++v) {
          if (e[v] > 0.f) last = v;
          run += e[v];
          if (run > target && e[v] > 0.f) return v;
        }
        continue;  // the block's own float sum rounded over the target: on to the next block
      }
      for (int64_t v = std::min(V, (b + 1) * BLOCK) - 1; v >= b * BLOCK; --v) {
        if (e[v] > 0.f) {
          last = v;
          break;
        }
      }
      run += blocks[b];
    }
  }
  return last;  // u * total rounded up to the total: the last token with any probability
}

// Per row of logits [B, V]: whether every value is finite, and the index of the first maximum (torch.argmax's
// answer; only meaningful for a finite row). One pass for the check and the max, one for the index: torch's
// isfinite(...).all() and argmax took ~0.6 ms for 8 rows of a 49k vocabulary, ~4% of a decode step.
std::tuple<at::Tensor, at::Tensor> greedy(const at::Tensor& logits) {
  check_rows(logits, "logits");
  const int64_t B = logits.size(0), V = logits.size(1), sl = logits.stride(0);
  TORCH_CHECK(V > 0, "logits must have at least one column");
  at::Tensor ids = at::empty({B}, logits.options().dtype(at::kLong));
  at::Tensor finite = at::empty({B}, logits.options().dtype(at::kBool));
  const float* pl = logits.data_ptr<float>();
  int64_t* pi = ids.data_ptr<int64_t>();
  bool* pf = finite.data_ptr<bool>();
  // one thread: ~7 us a row of 49k, and a parallel region measured no faster here
  for (int64_t b = 0; b < B; ++b) {
    const float* x = pl + b * sl;
    float mx = x[0], bad = 0.f;
#pragma omp simd reduction(max : mx) reduction(+ : bad)
    for (int64_t v = 0; v < V; ++v) {
      mx = x[v] > mx ? x[v] : mx;
      bad += (x[v] - x[v]) != 0.f ? 1.f : 0.f;  // x - x is NaN exactly for NaN and +-inf
    }
    int64_t at = 0;  // the first block of 64 holding the max, then the index in it
    for (; at + 64 <= V; at += 64) {
      int hit = 0;
#pragma omp simd reduction(| : hit)
      for (int64_t v = at; v < at + 64; ++v) hit |= x[v] == mx;
      if (hit) break;
    }
    while (at < V && x[at] != mx) ++at;
    pf[b] = bad == 0.f;
    pi[b] = at < V ? at : 0;
  }
  return {ids, finite};
}

// ---- A decode step's Llama layer on int8 or int4 weights in one parallel region ----
// The layer as separate ops (llama_layer below) wakes torch's threads for each matmul and for attention and leaves
// the norms, the rounding of x to int8, RoPE and the merge on one thread: at 8 rows the second thread waited ~40% of
// a step (perf, SmolLM2 int8, AMD EPYC, 2 threads). Here one region runs the whole layer, each phase split over the
// team (rows, output blocks, attention items) and closed by a barrier. Each phase calls the functions the ops call
// on the same values, so the layer gives the same bits.

#ifndef _OPENMP
inline int omp_get_thread_num() { return 0; }
inline int omp_get_num_threads() { return 1; }
#endif

// member `rank` of a team of `size`'s share [first, last) of n things
inline std::pair<int64_t, int64_t> share(int64_t n, int rank, int size) {
  return {n * rank / size, n * (rank + 1) / size};
}

// a quantized matrix's bytes and output rows (taken before the region: nothing in it may throw)
struct Matrix {
  const void* data;
  int64_t rows;
  explicit Matrix(const at::Tensor& w) : data(w.data_ptr()), rows(w.size(0)) {}
};

// x rounded to int8 groups for the layer's matmuls, row by row (a row's groups do not depend on the rows beside it),
// and those matmuls (uninitialized: a phase writes each row before the next phase reads it)
struct RoundedX {
  bool int4;
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<int16_t[]> q16;  // int8's vpmaddwd paths' copy (isa 1, 2)
  std::unique_ptr<float[]> s, sd;  // scales; int4's sums times scales
  std::unique_ptr<int32_t[]> sum;
  RoundedX(bool int4_weights, int64_t M, int64_t K)  // K: the widest input
      : int4(int4_weights), q(new int8_t[M * K]), q16(new int16_t[M * K]), s(new float[M * groups(K)]),
        sd(new float[M * groups(K)]), sum(new int32_t[M * groups(K)]) {}

  static int64_t groups(int64_t K) { return (K + wkvm::X_GROUP - 1) / wkvm::X_GROUP; }

  void rows(const float* x, int64_t K, int64_t r0, int64_t r1, int64_t isa) {
    const int64_t G = groups(K);
    wkvm::quantize_group_range(x, K, r0 * G, r1 * G, q.get(), s.get(), sum.get(), isa);
    if (int4) {
      for (int64_t i = r0 * G; i < r1 * G; ++i) sd[i] = static_cast<float>(sum[i]) * s[i];
    } else if (isa == 1 || isa == 2) {
      for (int64_t i = r0 * K; i < r1 * K; ++i) q16[i] = q[i];
    }
  }

  // this member's share of y [M, N] = x [M, K] @ w^T (w in int8_linear.cpp's or int4_linear.cpp's format)
  void matmul(const Matrix& w, float* y, int64_t M, int64_t K, int64_t isa, int rank, int size) const {
    const int64_t N = w.rows;
    if (int4) {
      namespace i4 = wkvm::int4;
      const i4::Problem p{q.get(), s.get(), sd.get(), static_cast<const uint8_t*>(w.data), y, M, N, K, groups(K),
                          N / i4::ROWS};
      split(p, i4::blocks_of(isa), i4::rows_scalar, i4::ROWS, rank, size);
    } else {
      namespace i8 = wkvm::int8;
      const i8::Problem p{q.get(), q16.get(), s.get(), sum.get(), static_cast<const int8_t*>(w.data), y, M, N, K,
                          groups(K), K % 2 ? 0 : N / i8::BLOCK};
      split(p, i8::blocks_of(isa), i8::rows_scalar, i8::BLOCK, rank, size);
    }
  }

  // this member's blocks, then its rows of those after the last block
  template <class P, class Blocks, class Rows>
  static void split(const P& p, Blocks blocks, Rows rows, int64_t block_rows, int rank, int size) {
    const auto [b0, b1] = share(p.blocks, rank, size);
    if (b0 < b1) blocks(p, b0, b1);
    const auto [n0, n1] = share(p.N - p.blocks * block_rows, rank, size);
    if (n0 < n1) rows(p, p.blocks * block_rows + n0, p.blocks * block_rows + n1);
  }
};

struct QuantLayer {
  const float *x, *in_norm, *post_norm;
  Matrix wqkv, wo, wgu, wdown;
  const int64_t* isa;  // per matrix
  float *qkv, *att, *proj, *s, *h, *gu, *act, *dn, *out;
  int64_t B, C, HD, F;  // rows, width, attention output width (Hq D), MLP width
  float eps;
};

// One layer's phases on this member of the team (a parallel region's): each closed by a barrier where the next reads
// what other members wrote. The layer ends on its own rows (the residual add), and the next layer begins on them
// (the norm and x's rounding), so layers follow each other without a barrier between.
template <class T>
void layer_phases(const QuantLayer& L, Attention<T>& att, RoundedX& xq, int rank, int size) {
  const int64_t B = L.B, C = L.C, F = L.F;
  const auto [r0, r1] = share(B, rank, size);
  for (int64_t r = r0; r < r1; ++r) norm_row(L.x + r * C, L.in_norm, L.h + r * C, C, L.eps);
  xq.rows(L.h, C, r0, r1, L.isa[0]);
#pragma omp barrier
  xq.matmul(L.wqkv, L.qkv, B, C, L.isa[0], rank, size);
#pragma omp barrier
  att.rows(r0, r1);
#pragma omp barrier
  const auto [i0, i1] = share(att.items, rank, size);
  att.work(i0, i1);
#pragma omp barrier
  att.merge(r0, r1);
  xq.rows(L.att, L.HD, r0, r1, L.isa[1]);
#pragma omp barrier
  xq.matmul(L.wo, L.proj, B, L.HD, L.isa[1], rank, size);
#pragma omp barrier
  for (int64_t r = r0; r < r1; ++r)
    add_norm_row(L.x + r * C, L.proj + r * C, L.post_norm, L.s + r * C, L.h + r * C, C, L.eps);
  xq.rows(L.h, C, r0, r1, L.isa[2]);
#pragma omp barrier
  xq.matmul(L.wgu, L.gu, B, C, L.isa[2], rank, size);
#pragma omp barrier
  for (int64_t r = r0; r < r1; ++r) silu_span(L.gu + r * 2 * F, L.act + r * F, F, 0, F);
  xq.rows(L.act, F, r0, r1, L.isa[3]);
#pragma omp barrier
  xq.matmul(L.wdown, L.dn, B, F, L.isa[3], rank, size);
#pragma omp barrier
  for (int64_t r = r0; r < r1; ++r) {
    const float *a = L.s + r * C, *b = L.dn + r * C;
    float* o = L.out + r * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] = a[c] + b[c];
  }
}

// the layers in order in one parallel region
template <class T>
void quant_layers(const std::vector<QuantLayer>& layers, std::vector<Attention<T>>& atts, RoundedX& xq) {
  at::internal::lazy_init_num_threads();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int rank = omp_get_thread_num(), size = omp_get_num_threads();
    for (size_t l = 0; l < layers.size(); ++l) layer_phases(layers[l], atts[l], xq, rank, size);
  }
}

// The input width of an int8 [N, K + 4] or int4 [N, K / 32 * 20] matrix (checked)
int64_t in_width(const at::Tensor& w, bool int4) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == (int4 ? at::kByte : at::kChar) && w.is_contiguous() &&
                  w.device().is_cpu(),
              int4 ? "int4 weights must be contiguous uint8 [N, K / 32 * 20]" : "int8 weights must be contiguous int8 [N, K + 4]",
              " on the CPU");
  if (!int4) return w.size(1) - 4;
  TORCH_CHECK(w.size(1) % wkvm::int4::ROW_BYTES == 0, "int4 weight rows must hold whole groups of 20 bytes");
  return w.size(1) / wkvm::int4::ROW_BYTES * wkvm::int4::GROUP;
}

// Layers 0..L-1 of a decode step on int8 or int4 weights (`llama_layers`' lists: two norms, four matrices, eight
// kernel arguments (args[2 j]: matrix j's kernel path) and a key and value pool a layer) in one parallel region;
// x2 [B, C]. Each layer's buffers are the same memory (layer l's output the next one's input, two alternating),
// allocated and checked once a call: per layer that had cost ~7 us of allocations, views and checks (SmolLM2 int8,
// AMD EPYC, session 43), ~0.2 ms of a step.
at::Tensor llama_layers_quant(bool int4, const at::Tensor& x2, at::TensorList norms, at::TensorList mats,
                              at::IntArrayRef args, double eps, const at::Tensor& cos, const at::Tensor& sin,
                              at::TensorList kflats, at::TensorList vflats, const at::Tensor& table,
                              const at::Tensor& lengths, int64_t page_tokens, double scale, int64_t Hq, int64_t Hkv) {
  const size_t L = kflats.size();
  TORCH_CHECK(L > 0 && vflats.size() == L && norms.size() == 2 * L && mats.size() == 4 * L && args.size() == 8 * L,
              "per layer two norms, four matrices, eight kernel arguments and a key and value pool");
  const int64_t B = x2.size(0), C = x2.size(1), D = kflats[0].size(2), HD = Hq * D, F = mats[2].size(0) / 2;
  const int64_t best = int4 ? wkvm::int4::best_isa() : wkvm::int8::best_isa();
  std::vector<int64_t> isas(4 * L);
  for (size_t l = 0; l < L; ++l) {
    const at::Tensor &wqkv = mats[4 * l], &wo = mats[4 * l + 1], &wgu = mats[4 * l + 2], &wdown = mats[4 * l + 3];
    TORCH_CHECK(wqkv.size(0) == (Hq + 2 * Hkv) * D && in_width(wqkv, int4) == C && wo.size(0) == C &&
                    in_width(wo, int4) == HD && wgu.size(0) == 2 * F && in_width(wgu, int4) == C &&
                    wdown.size(0) == C && in_width(wdown, int4) == F,
                "the weights must be qkv [(Hq + 2 Hkv) D, C], o [C, Hq D], gate_up [2 F, C], down [C, F] (out, in)");
    for (int j = 0; j < 4; ++j) {
      const int64_t isa = args[8 * l + 2 * j];
      TORCH_CHECK(isa >= 0 && isa <= best, "this CPU cannot run kernel isa ", isa);
      isas[4 * l + j] = isa;
    }
    for (const at::Tensor& n : {norms[2 * l], norms[2 * l + 1]})
      TORCH_CHECK(n.is_contiguous() && n.scalar_type() == at::kFloat && n.numel() == C, "norms must be float32 [C]");
    for (const at::Tensor& pool : {kflats[l], vflats[l]})  // as layer 0's, which problem_of checks below
      TORCH_CHECK(pool.is_contiguous() && pool.sizes() == kflats[0].sizes() &&
                      pool.scalar_type() == kflats[0].scalar_type() && pool.device() == kflats[0].device(),
                  "every layer's key and value pools must be alike");
  }
  const auto opts = x2.options();
  at::Tensor qkv = at::empty({B, mats[0].size(0)}, opts), att = at::empty({B, 1, Hq, D}, opts);
  // the layers' intermediates, one after another: proj, s, h [B, C], gu [B, 2 F], act [B, F], dn [B, C]; and
  // their outputs, alternately into two [B, 1, C]
  at::Tensor work = at::empty({B, 4 * C + 3 * F}, opts);
  const at::Tensor outs[2] = {at::empty({B, 1, C}, opts), at::empty({B, 1, C}, opts)};
  const at::Tensor q = qkv.narrow(1, 0, HD).view({B, 1, Hq, D});
  const at::Tensor k = qkv.narrow(1, HD, Hkv * D).view({B, 1, Hkv, D});
  const at::Tensor v = qkv.narrow(1, HD + Hkv * D, Hkv * D).view({B, 1, Hkv, D});
  float* next = work.data_ptr<float>();
  const auto take = [&](int64_t width) { return std::exchange(next, next + B * width); };
  float *proj = take(C), *s = take(C), *h = take(C), *gu = take(2 * F), *act = take(F), *dn = take(C);
  // one Problem for every layer (the same rows, pages and lengths; the pools are alike, checked above): its pages
  // are checked against the pool once, not once a layer (at B=8 after 1,024 tokens, 512 pages a layer)
  const Problem pr = problem_of(q, k, v, cos, sin, kflats[0], vflats[0], table, lengths, page_tokens, scale, att);
  std::vector<QuantLayer> layers;
  layers.reserve(L);
  for (size_t l = 0; l < L; ++l) {
    const float* x = l == 0 ? x2.data_ptr<float>() : outs[(l - 1) % 2].data_ptr<float>();
    layers.push_back(QuantLayer{x, norms[2 * l].data_ptr<float>(), norms[2 * l + 1].data_ptr<float>(),
                                Matrix(mats[4 * l]), Matrix(mats[4 * l + 1]), Matrix(mats[4 * l + 2]),
                                Matrix(mats[4 * l + 3]), isas.data() + 4 * l, qkv.data_ptr<float>(),
                                att.data_ptr<float>(), proj, s, h, gu, act, dn, outs[l % 2].data_ptr<float>(), B, C,
                                HD, F, static_cast<float>(eps)});
  }
  RoundedX xq(int4, B, std::max({C, HD, F}));
  // every layer's Attention (the same rows and lengths, so the same items) works in the first one's buffer
  const auto run = [&](auto* pool_type) {
    using T = std::remove_pointer_t<decltype(pool_type)>;
    std::vector<Attention<T>> atts;
    atts.reserve(L);
    for (size_t l = 0; l < L; ++l)
      atts.emplace_back(pr, kflats[l].data_ptr<T>(), vflats[l].data_ptr<T>(), l ? atts[0].acc : nullptr);
    quant_layers(layers, atts, xq);
  };
  if (kflats[0].scalar_type() == at::kHalf) {
    run(static_cast<half*>(nullptr));
  } else {
    run(static_cast<float*>(nullptr));
  }
  return outs[(L - 1) % 2];
}

// llama_layer's int8 / int4 case: llama_layers_quant on one layer
at::Tensor llama_layer_quant(bool int4, const at::Tensor& x2, const at::Tensor& in_norm, const at::Tensor& post_norm,
                             const at::Tensor& wqkv, const at::Tensor& wo, const at::Tensor& wgu,
                             const at::Tensor& wdown, at::IntArrayRef args, double eps, const at::Tensor& cos,
                             const at::Tensor& sin, const at::Tensor& kflat, const at::Tensor& vflat,
                             const at::Tensor& table, const at::Tensor& lengths, int64_t page_tokens, double scale,
                             int64_t Hq, int64_t Hkv) {
  const std::array<at::Tensor, 2> norms{in_norm, post_norm};
  const std::array<at::Tensor, 4> mats{wqkv, wo, wgu, wdown};
  const std::array<at::Tensor, 1> kf{kflat}, vf{vflat};
  return llama_layers_quant(int4, x2, norms, mats, args, eps, cos, sin, kf, vf, table, lengths, page_tokens, scale,
                            Hq, Hkv);
}

// One decode step (T = 1) of a pre-norm attention + SiLU-MLP layer (Llama): the ops the Python path runs, in its
// order and on the same kernels (linear_call.h), so the same bits, without the ~50 us of Python and views a layer
// measured on SmolLM2 (int8, one row, AMD EPYC). On int8 or int4 weights the whole layer runs in one parallel
// region (llama_layer_quant: the same functions on the same values).
// `kernel` and `args` (two a matrix): linear_call.h's.
at::Tensor llama_layer(const at::Tensor& x, const at::Tensor& in_norm, const at::Tensor& post_norm,
                       const at::Tensor& wqkv, const at::Tensor& wo, const at::Tensor& wgu, const at::Tensor& wdown,
                       const std::string& kernel, at::IntArrayRef args, double eps, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& kflat, const at::Tensor& vflat, const at::Tensor& table,
                       const at::Tensor& lengths, int64_t page_tokens, double scale, int64_t Hq, int64_t Hkv) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.is_contiguous(), "x must be contiguous [B, 1, C]");
  TORCH_CHECK(args.size() == 8, "args: two a matrix");
  const int64_t B = x.size(0), C = x.size(2), D = kflat.size(2);
  const at::Tensor x2 = x.view({B, C});
  if (kernel == "wkvm_int8" || kernel == "wkvm_int4")
    return llama_layer_quant(kernel == "wkvm_int4", x2, in_norm, post_norm, wqkv, wo, wgu, wdown, args, eps, cos, sin,
                             kflat, vflat, table, lengths, page_tokens, scale, Hq, Hkv);
  const wkvm::LinearCall& linear = wkvm::linear_call(kernel);
  const at::Tensor qkv = linear(rms_norm(x2, in_norm, eps), wqkv, args[0], args[1]);
  TORCH_CHECK(qkv.size(1) == (Hq + 2 * Hkv) * D, "wqkv must give Hq + 2 Hkv heads of D");
  const at::Tensor q = qkv.narrow(1, 0, Hq * D).view({B, 1, Hq, D});
  const at::Tensor k = qkv.narrow(1, Hq * D, Hkv * D).view({B, 1, Hkv, D});
  const at::Tensor v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({B, 1, Hkv, D});
  const at::Tensor o = rope_attend(q, k, v, cos, sin, kflat, vflat, table, lengths, page_tokens, scale);
  auto [s, h] = add_rms_norm(x2, linear(o.view({B, Hq * D}), wo, args[2], args[3]), post_norm, eps);
  const at::Tensor y = linear(silu_mul(linear(h, wgu, args[4], args[5])), wdown, args[6], args[7]);
  return at::add(s, y).view({B, 1, C});
}

// A decode step's every layer in one call: llama_layer for layer 0, 1, ... in order, each on the one before's output
// (the same calls on the same values, so the same bits), without going back to Python between layers. Layer i's
// norms are norms[2 i], norms[2 i + 1], its matrices mats[4 i .. 4 i + 3] (qkv, o, gate_up, down), their kernel
// arguments args[8 i .. 8 i + 7] on one `kernel`, its pools kflats[i], vflats[i]; the pages and angles are the step's.
at::Tensor llama_layers(const at::Tensor& x, at::TensorList norms, at::TensorList mats, const std::string& kernel,
                        at::IntArrayRef args, double eps, const at::Tensor& cos, const at::Tensor& sin,
                        at::TensorList kflats, at::TensorList vflats, const at::Tensor& table,
                        const at::Tensor& lengths, int64_t page_tokens, double scale, int64_t Hq, int64_t Hkv) {
  const int64_t L = static_cast<int64_t>(kflats.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(vflats.size()) == L && static_cast<int64_t>(norms.size()) == 2 * L &&
                  static_cast<int64_t>(mats.size()) == 4 * L && static_cast<int64_t>(args.size()) == 8 * L,
              "llama_layers: per layer two norms, four matrices, eight kernel arguments and a key and value pool");
  if (kernel == "wkvm_int8" || kernel == "wkvm_int4") {
    TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.is_contiguous(), "x must be contiguous [B, 1, C]");
    return llama_layers_quant(kernel == "wkvm_int4", x.view({x.size(0), x.size(2)}), norms, mats, args, eps, cos, sin,
                              kflats, vflats, table, lengths, page_tokens, scale, Hq, Hkv);
  }
  at::Tensor y = x;
  for (int64_t i = 0; i < L; ++i) {
    y = llama_layer(y, norms[2 * i], norms[2 * i + 1], mats[4 * i], mats[4 * i + 1], mats[4 * i + 2],
                    mats[4 * i + 3], kernel, args.slice(8 * i, 8), eps, cos, sin, kflats[i], vflats[i], table,
                    lengths, page_tokens, scale, Hq, Hkv);
  }
  return y;
}

// whether the attention here groups a prompt chunk's rows (Attention::group, a chunk of keys at a time: ROW_GROUPS,
// built with AVX-512 or AVX2 + FMA); without it each row reads the keys alone, several times slower than torch's
// attention on a long chunk (llama/model.py asks)
bool wide_attention() { return ROW_GROUPS; }

}  // namespace

TORCH_LIBRARY(wkvm_fused, m) {
  m.def("wide_attention() -> bool", &wide_attention);
  m.def("greedy(Tensor logits) -> (Tensor, Tensor)", &greedy);
  m.def(
      "sample(Tensor logits, float temperature, int top_k, float top_p, float min_p, float u, Tensor? counts, "
      "Tensor? seen, float frequency, float presence, float repetition) -> int",
      &sample);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor a, Tensor w, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("silu_mul(Tensor gu) -> Tensor", &silu_mul);
  m.def(
      "rope_attend(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) kflat, Tensor(b!) vflat, "
      "Tensor table, Tensor lengths, int page_tokens, float scale) -> Tensor",
      &rope_attend);
  m.def(
      "llama_layer(Tensor x, Tensor in_norm, Tensor post_norm, Tensor wqkv, Tensor wo, Tensor wgu, Tensor wdown, "
      "str kernel, int[] args, float eps, Tensor cos, Tensor sin, Tensor(a!) kflat, Tensor(b!) vflat, Tensor table, "
      "Tensor lengths, int page_tokens, float scale, int Hq, int Hkv) -> Tensor",
      &llama_layer);
  m.def(
      "llama_layers(Tensor x, Tensor[] norms, Tensor[] mats, str kernel, int[] args, float eps, Tensor cos, "
      "Tensor sin, Tensor(a!)[] kflats, Tensor(b!)[] vflats, Tensor table, Tensor lengths, int page_tokens, "
      "float scale, int Hq, int Hkv) -> Tensor",
      &llama_layers);
}
