// Small fp32 matrix products in register tiles for wkvm's chunked recurrences (qwen3_5/gated_delta.cpp,
// mamba2/ssd.cpp): a chunk's products are a few dozen rows by a head's width, too small for a BLAS call per product
// to pay. int8.load_kernel hashes the headers a source includes with quotes, so editing this file rebuilds both.
#pragma once

#include <cstdint>
#include <cstring>

namespace wkvm {

// C[m][n] = c_scale C[m][n] + alpha sum_k A[m][k] B[k][n] (c_scale 0: C is only written) for m < M, n < N, k < K;
// row strides lda, ldb, ldc. Tiles of kRows rows x kVecs vectors keep their sums in registers and load each row of B
// once for all their rows (written with vector types: the compiler's own loops reloaded B for every row, which made
// the products load-bound): 8 x 32 on AVX-512 (16 of its 32 registers), 4 x 16 on AVX2 (8 of 16).
#if defined(__AVX512F__)
constexpr int kWidth = 16, kRows = 8;
#else
constexpr int kWidth = 8, kRows = 4;
#endif
constexpr int kVecs = 2;
typedef float vec __attribute__((vector_size(kWidth * 4), aligned(4)));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

template <int R, int V>
inline void tile(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                 float alpha, float c_scale) {
  vec acc[R][V] = {};
  for (int64_t k = 0; k < K; ++k) {
    vec b[V];
    for (int c = 0; c < V; ++c) b[c] = load(B + k * ldb + c * kWidth);
    for (int r = 0; r < R; ++r) {
      const float a = A[r * lda + k];
      for (int c = 0; c < V; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) {
      float* out = C + r * ldc + c * kWidth;
      store(out, c_scale != 0.0f ? c_scale * load(out) + alpha * acc[r][c] : alpha * acc[r][c]);
    }
}

// columns left over after the tiles (fewer than kWidth): one row at a time
inline void narrow(int64_t K, int64_t N, const float* A, const float* B, int64_t ldb, float* C, float alpha, float c_scale) {
  float acc[kWidth] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float a = A[k];
    const float* b = B + k * ldb;
    for (int64_t c = 0; c < N; ++c) acc[c] += a * b[c];
  }
  for (int64_t c = 0; c < N; ++c) C[c] = (c_scale != 0.0f ? c_scale * C[c] : 0.0f) + alpha * acc[c];
}

template <int R>
inline void row_block(int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
               float alpha, float c_scale) {
  int64_t n = 0;
  for (; n + kVecs * kWidth <= N; n += kVecs * kWidth)
    tile<R, kVecs>(K, A, lda, B + n, ldb, C + n, ldc, alpha, c_scale);
  for (; n + kWidth <= N; n += kWidth) tile<R, 1>(K, A, lda, B + n, ldb, C + n, ldc, alpha, c_scale);
  for (int r = 0; r < R && n < N; ++r) narrow(K, N - n, A + r * lda, B + n, ldb, C + r * ldc + n, alpha, c_scale);
}

inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
          int64_t ldc, float alpha, float c_scale) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows)
    row_block<kRows>(N, K, A + m * lda, lda, B, ldb, C + m * ldc, ldc, alpha, c_scale);
  for (; m < M; ++m) row_block<1>(N, K, A + m * lda, lda, B, ldb, C + m * ldc, ldc, alpha, c_scale);
}

}  // namespace wkvm
