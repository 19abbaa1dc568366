// x rounded to int8 per group of 32 values along K, shared by the int8 and int4 kernels (llama.cpp's q8 activation
// blocks do the same). int8.load_kernel hashes the headers a source includes with quotes, so editing this file
// rebuilds both kernels.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace wkvm {

constexpr int64_t X_GROUP = 32;

// Row m's group g holds x[m, 32g .. min(K, 32g + 32)) (only a row's last group can be shorter); G = ceil(K / 32).
// scale[m * G + g] = max|x| / 127 over the group, q = x / scale rounded to nearest (ties to even) in -127..127,
// sum[m * G + g] = the group's sum of q. Every path does the same float operations on each value (the multiply, the
// clamps, the rounding add and subtract; a maximum is exact in any order), so every kernel path sees the same
// integers and scales. NaN is skipped by the maximum and becomes q = 0, as in the portable code.
constexpr float ROUND = 12582912.f;  // 1.5 * 2^23: adding then subtracting it rounds to nearest, ties to even

inline float group_inverse(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }

// one group of n values, portable C++
inline void quantize_group(const float* r, int64_t n, int8_t* q, float* scale, int32_t* sum) {
  float amax = 0.f;
  for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(r[k]));
  const float inv = group_inverse(amax);
  *scale = amax / 127.f;
  int32_t s = 0;
  for (int64_t k = 0; k < n; ++k) {
    float v = r[k] * inv;
    v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
    const int32_t qi = static_cast<int32_t>((v + ROUND) - ROUND);
    q[k] = static_cast<int8_t>(qi);
    s += qi;
  }
  *sum = s;
}

#if defined(__x86_64__) || defined(_M_X64)
// groups i0 .. i1 when K is a multiple of 32 (group i then starts at x + 32 i, its values at q + 32 i), with AVX-512:
// 16 groups at a time, their maxima first, then their inverses and scales as two vector divisions (the IEEE quotients
// of the portable code's scalar ones), then their values. The version before took one group per call, its two
// scalar divisions in the chain of each: a 32 x 1,536 int8 product (48 groups of x a row) ran 5.9-7.0 -> 3.9-4.4 us at
// one row and 9.5-14.7 -> 9.4-11.0 us at eight (AMD EPYC avx512, one thread, three alternating runs each).
__attribute__((target("avx512f,avx512bw"))) inline void quantize_whole_groups_avx512(const float* x, int64_t i0, int64_t i1,
                                                                                     int8_t* q, float* scale,
                                                                                     int32_t* sum) {
  constexpr int64_t CHUNK = 16;  // K is a multiple of X_GROUP: group i starts at x + X_GROUP * i, as does q's
  const __m512 hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f), round = _mm512_set1_ps(ROUND);
  for (int64_t c = i0; c < i1; c += CHUNK) {
    const int64_t n = std::min(CHUNK, i1 - c);
    // the maxima go into their lanes in registers: stored one by one and loaded as a vector, each chunk's load waited
    // for its 16 stores to leave the store queue (no forwarding): ~46% of this function's samples in an 8-row decode
    __m512 a = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const float* r = x + X_GROUP * (c + j);
      // max(|x|, acc) keeps acc where |x| is NaN, as std::max(acc, |x|) does
      const __m512 lo_half = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(r)), _mm512_setzero_ps());
      const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(r + 16)), lo_half));
      a = _mm512_mask_broadcastss_ps(a, static_cast<__mmask16>(1u << j), _mm_set_ss(m));
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    // group_inverse: 127 / amax where amax > 0, else 0
    const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ), hi, a);
    _mm512_mask_storeu_ps(scale + c, valid, _mm512_div_ps(a, hi));
    for (int64_t j = 0; j < n; ++j) {
      const float* r = x + X_GROUP * (c + j);
      const __m512 iv = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(j)), inv);
      __m512i s = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(r + 16 * h), iv);
        v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, hi, _CMP_GT_OQ), v, hi);
        v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, lo, _CMP_LT_OQ), v, lo);
        const __m512i qi = _mm512_cvttps_epi32(_mm512_sub_ps(_mm512_add_ps(v, round), round));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + X_GROUP * (c + j) + 16 * h), _mm512_cvtepi32_epi8(qi));
        s = _mm512_add_epi32(s, qi);
      }
      sum[c + j] = _mm512_reduce_add_epi32(s);
    }
  }
}

// the same with AVX2 (four registers)
__attribute__((target("avx2,fma"))) inline void quantize_group_avx2(const float* r, int8_t* q, float* scale,
                                                                     int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(r + 8 * i);
    m = _mm256_max_ps(_mm256_andnot_ps(sign, x[i]), m);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.f;
  for (float l : lanes) amax = std::max(amax, l);
  const __m256 inv = _mm256_set1_ps(group_inverse(amax));
  *scale = amax / 127.f;
  const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f), round = _mm256_set1_ps(ROUND);
  // bytes 0, 4, 8, 12 of each 128-bit half: the low byte of each 32-bit value, as the cast to int8 takes
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i halves = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
  __m256i s = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    __m256 v = _mm256_mul_ps(x[i], inv);
    v = _mm256_blendv_ps(v, hi, _mm256_cmp_ps(v, hi, _CMP_GT_OQ));
    v = _mm256_blendv_ps(v, lo, _mm256_cmp_ps(v, lo, _CMP_LT_OQ));
    const __m256i qi = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(v, round), round));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(qi, pick), halves);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + 8 * i), _mm256_castsi256_si128(bytes));
    s = _mm256_add_epi32(s, qi);
  }
  alignas(32) int32_t parts[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(parts), s);
  int32_t total = 0;
  for (int32_t p : parts) total += p;
  *sum = total;
}
#endif

// groups i0 .. i1 of x [M, K] (group i is row i / G's group i % G); isa as the kernels number them: 0 portable, 1
// AVX2, 2-3 AVX-512 (BW). The result of a group does not depend on the range it is rounded in.
inline void quantize_group_range(const float* x, int64_t K, int64_t i0, int64_t i1, int8_t* q, float* scale,
                                 int32_t* sum, int64_t isa) {
  const int64_t G = (K + X_GROUP - 1) / X_GROUP;
#if defined(__x86_64__) || defined(_M_X64)
  if (K % X_GROUP == 0 && isa >= 2) {
    quantize_whole_groups_avx512(x, i0, i1, q, scale, sum);
    return;
  }
#endif
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t m = i / G, k0 = (i % G) * X_GROUP, n = std::min(X_GROUP, K - k0);
    const float* r = x + m * K + k0;
#if defined(__x86_64__) || defined(_M_X64)
    if (n == X_GROUP && isa >= 1) {  // AVX-512 machines too, where K is not a multiple of 32
      quantize_group_avx2(r, q + m * K + k0, scale + i, sum + i);
      continue;
    }
#endif
    quantize_group(r, n, q + m * K + k0, scale + i, sum + i);
  }
}

// every group of x [M, K], split over torch's threads
inline void quantize_groups(const float* x, int64_t M, int64_t K, int8_t* q, float* scale, int32_t* sum,
                            int64_t isa) {
  const int64_t G = (K + X_GROUP - 1) / X_GROUP;
  at::parallel_for(0, M * G, 512,
                   [&](int64_t i0, int64_t i1) { quantize_group_range(x, K, i0, i1, q, scale, sum, isa); });
}

}  // namespace wkvm
