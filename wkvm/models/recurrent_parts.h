// What the recurrent families' C++ kernels share (qwen3_5/gated_delta.cpp, mamba2/ssd.cpp): checks of the layouts
// they read, the short causal conv's one-token step with SiLU, and torch's own softplus. int8.load_kernel hashes the
// headers a source includes with quotes, so editing this file rebuilds both.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace wkvm {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

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

// One token x [C] of the depthwise causal conv after `window` [C, K-1] (oldest first; advanced in place):
// out[c] = silu(window[c] . weight[c, :K-1] + x[c] weight[c, K-1] (+ bias[c] where bias is given)).
inline void conv_silu_step(const float* x, float* window, const float* weight, const float* bias, int64_t C, int64_t K,
                           float* out) {
  for (int64_t c = 0; c < C; ++c) {
    float* wc = window + c * (K - 1);
    const float* kc = weight + c * K;
    float acc = 0.0f;
    for (int64_t j = 0; j < K - 1; ++j) acc += wc[j] * kc[j];
    acc += x[c] * kc[K - 1];
    for (int64_t j = 0; j + 1 < K - 1; ++j) wc[j] = wc[j + 1];
    wc[K - 2] = x[c];
    out[c] = silu(bias != nullptr ? acc + bias[c] : acc);
  }
}

}  // namespace wkvm
