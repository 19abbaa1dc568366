// What the recurrent families' C++ kernels share (qwen3_5/gated_delta.cpp, mamba2/ssd.cpp): checks of the layouts
// they read, the short causal conv with SiLU token after token, and torch's own softplus. int8.load_kernel hashes the
// headers a source includes with quotes, so editing this file rebuilds both.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

// (exp_approx: a source includes simd_math.h before this file; includes are resolved beside the source)

namespace wkvm {

// torch's F.softplus (beta 1, threshold 20)
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

inline void check_cpu_fp32(std::initializer_list<const at::Tensor*> tensors, const char* op) {
  for (const at::Tensor* t : tensors)
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), op, " takes CPU float32 tensors");
}

// x [B, T, H, d] with any batch and token strides, each token's heads contiguous rows
inline void check_heads(const at::Tensor& x, int64_t B, int64_t T, int64_t H, int64_t d, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), name, " must be a CPU float32 tensor");
  TORCH_CHECK(x.dim() == 4 && x.size(0) == B && x.size(1) == T && x.size(2) == H && x.size(3) == d &&
                  x.stride(3) == 1 && x.stride(2) == d,
              name, " must be [", B, ", ", T, ", ", H, ", ", d, "] with each token's heads contiguous");
}

// the conv's weight [C, K] (K >= 2) and its window of the last K-1 inputs [B, C, K-1], both contiguous
inline void check_conv(const at::Tensor& conv, const at::Tensor& window, int64_t B, int64_t C) {
  const int64_t K = conv.size(1);
  TORCH_CHECK(conv.is_contiguous() && conv.dim() == 2 && conv.size(0) == C && K >= 2, "conv must be [", C, ", K]");
  TORCH_CHECK(window.is_contiguous() && window.dim() == 3 && window.size(0) == B && window.size(1) == C &&
                  window.size(2) == K - 1,
              "window must be contiguous [", B, ", ", C, ", ", K - 1, "]");
}

// A row of `C` floats padded to a multiple of 16 (64 bytes): every token's row of a scratch buffer then starts at
// the same alignment, so a vectorized loop over it splits its sums the same way for every token and row count.
inline int64_t padded_row(int64_t C) { return (C + 15) / 16 * 16; }

// silu with `exp_approx` (it vectorizes; std::exp does not, and Mamba2 130m's conv had spent ~0.3 s of a 1,024-token
// prefill in it, a channel at a time)
inline float silu_approx(float x) { return x / (1.0f + exp_approx(-x)); }

// T tokens of the depthwise causal conv with SiLU for each of B rows, token after token: x's token t of row r at
// x + r * xsb + t * xst ([C] contiguous), its output at out + (r T + t) * out_stride; out[c] = silu(window[c] .
// weight[c, :K-1] + x[c] weight[c, K-1] (+ bias[c] where bias is given)), and the window [B, C, K-1] (oldest first)
// advances. A decode step is T = 1 with the same arithmetic. Threads take blocks of channels through every row's T
// tokens, the block's weights and a row's window transposed so that each token's sums run across channels in vectors.
inline void conv_silu_steps(const float* x, int64_t xsb, int64_t xst, float* window, const float* weight,
                            const float* bias, int64_t B, int64_t T, int64_t C, int64_t K, float* out,
                            int64_t out_stride) {
  constexpr int64_t block = 256;
  const int64_t blocks = (C + block - 1) / block;
  at::parallel_for(0, blocks, 1, [&](int64_t i0, int64_t i1) {
    // weight[c, j] at wT[j * block + c]; a row's window inputs oldest first in rows[0 .. K-2], a ring over `ring`
    std::vector<float> wT(K * block), ring((K - 1) * block);
    std::vector<float*> rows(K - 1);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t c0 = item * block, n = std::min(block, C - c0);
      for (int64_t c = 0; c < n; ++c)
        for (int64_t j = 0; j < K; ++j) wT[j * block + c] = weight[(c0 + c) * K + j];
      const float* last = wT.data() + (K - 1) * block;
      const float* bc = bias != nullptr ? bias + c0 : nullptr;
      for (int64_t r = 0; r < B; ++r) {
        float* win = window + (r * C + c0) * (K - 1);
        for (int64_t j = 0; j < K - 1; ++j) {
          rows[j] = ring.data() + j * block;
          for (int64_t c = 0; c < n; ++c) rows[j][c] = win[c * (K - 1) + j];
        }
        for (int64_t t = 0; t < T; ++t) {
          const float* xt = x + r * xsb + t * xst + c0;
          float* o = out + (r * T + t) * out_stride + c0;
#pragma omp simd
          for (int64_t c = 0; c < n; ++c) o[c] = 0.0f;
          for (int64_t j = 0; j < K - 1; ++j) {
            const float* wj = wT.data() + j * block;
            const float* in = rows[j];
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) o[c] += in[c] * wj[c];
          }
          float* oldest = rows[0];  // becomes the newest input
#pragma omp simd
          for (int64_t c = 0; c < n; ++c) {
            const float acc = o[c] + xt[c] * last[c];
            oldest[c] = xt[c];
            o[c] = silu_approx(bc != nullptr ? acc + bc[c] : acc);
          }
          std::rotate(rows.begin(), rows.begin() + 1, rows.end());
        }
        for (int64_t j = 0; j < K - 1; ++j)
          for (int64_t c = 0; c < n; ++c) win[c * (K - 1) + j] = rows[j][c];
      }
    }
  });
}

}  // namespace wkvm
