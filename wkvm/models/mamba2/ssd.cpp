// Mamba2's one-token mixer step between its two projections (wkvm/models/mamba2/ssd.py builds this file on first
// use and keeps the torch ops as fallback and as the reference in tests); everything is fp32.
//
//   decode(proj [b, d_inner + conv_dim + H] (rows contiguous; z is not read), window [b, conv_dim, K-1] (in/out),
//       conv [conv_dim, K], conv_bias [conv_dim], S [b, H, P, N] (in/out), dt_bias, A, D [H], G, clamp, dt_min,
//       dt_max) -> y [b, H P]
//     [x B C] = silu(causal conv over the window + bias) (the window advances); dt = softplus(dt + dt_bias), clamped
//     to [dt_min, dt_max] when `clamp`; per head h (group g = h / (H / G)) and row p of its state:
//     S[p] = e^(dt A) S[p] + dt x[p] B_g,  y[p] = S[p] . C_g + D x[p].
//     One pass over the state: at 32 sequences the state (19 MB a sequence at the 130m shape), not the weights, is
//     what a decode step streams, and the torch ops' three passes (scale, rank-1 add, read out) took 161 ms of a
//     247 ms step there (AMD EPYC Zen 4, 2 threads).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

at::Tensor decode(const at::Tensor& proj, at::Tensor& window, const at::Tensor& conv, const at::Tensor& conv_bias,
                  at::Tensor& S, const at::Tensor& dt_bias, const at::Tensor& A, const at::Tensor& D, int64_t G,
                  bool clamp, double dt_min, double dt_max) {
  const int64_t b = S.size(0), H = S.size(1), P = S.size(2), N = S.size(3), d_inner = H * P;
  const int64_t CD = d_inner + 2 * G * N, K = conv.size(1), width = d_inner + CD + H;
  const std::initializer_list<const at::Tensor*> all{&proj, &window, &conv, &conv_bias, &S, &dt_bias, &A, &D};
  for (const at::Tensor* t : all)
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), "decode takes CPU float32 tensors");
  TORCH_CHECK(G > 0 && H % G == 0, "heads (", H, ") must be a multiple of groups (", G, ")");
  TORCH_CHECK(S.is_contiguous() && S.dim() == 4, "S must be contiguous [b, H, P, N]");
  TORCH_CHECK(proj.dim() == 2 && proj.size(0) == b && proj.size(1) == width && proj.stride(1) == 1,
              "proj must be [", b, ", ", width, "] with contiguous rows");
  TORCH_CHECK(conv.is_contiguous() && conv.dim() == 2 && conv.size(0) == CD && K >= 2, "conv must be [", CD, ", K]");
  TORCH_CHECK(window.is_contiguous() && window.dim() == 3 && window.size(0) == b && window.size(1) == CD &&
                  window.size(2) == K - 1,
              "window must be contiguous [", b, ", ", CD, ", ", K - 1, "]");
  TORCH_CHECK(conv_bias.is_contiguous() && conv_bias.numel() == CD && dt_bias.is_contiguous() &&
                  dt_bias.numel() == H && A.is_contiguous() && A.numel() == H && D.is_contiguous() && D.numel() == H,
              "conv_bias [", CD, "], dt_bias, A and D [", H, "] must be contiguous");
  at::Tensor mixed = at::empty({b, CD}, proj.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor out = at::empty({b, d_inner}, proj.options().memory_format(at::MemoryFormat::Contiguous));
  const float *pp = proj.data_ptr<float>(), *cw = conv.data_ptr<float>(), *cb = conv_bias.data_ptr<float>();
  const float *dtb = dt_bias.data_ptr<float>(), *Ap = A.data_ptr<float>(), *Dp = D.data_ptr<float>();
  float *win = window.data_ptr<float>(), *mx = mixed.data_ptr<float>(), *Sp = S.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ps = proj.stride(0), hpg = H / G;
  at::parallel_for(0, b, 1, [&](int64_t r0, int64_t r1) {  // the conv and SiLU; the window advances
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = pp + r * ps + d_inner;
      float* w = win + r * CD * (K - 1);
      for (int64_t c = 0; c < CD; ++c) {
        float* wc = w + c * (K - 1);
        const float* kc = cw + c * K;
        float acc = 0.0f;
        for (int64_t j = 0; j < K - 1; ++j) acc += wc[j] * kc[j];
        acc += x[c] * kc[K - 1];
        for (int64_t j = 0; j + 1 < K - 1; ++j) wc[j] = wc[j + 1];
        wc[K - 2] = x[c];
        mx[r * CD + c] = silu(acc + cb[c]);
      }
    }
  });
  at::parallel_for(0, b * H, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t r = item / H, h = item % H, g = h / hpg;
      const float a = pp[r * ps + d_inner + CD + h] + dtb[h];
      float dt = a > 20.0f ? a : std::log1p(std::exp(a));  // torch's softplus (threshold 20)
      if (clamp) dt = std::min(std::max(dt, static_cast<float>(dt_min)), static_cast<float>(dt_max));
      const float decay = std::exp(dt * Ap[h]);
      const float* x = mx + r * CD + h * P;
      const float* Bg = mx + r * CD + d_inner + g * N;
      const float* Cg = mx + r * CD + d_inner + G * N + g * N;
      float* Sh = Sp + item * P * N;
      float* y = op + item * P;
      for (int64_t p = 0; p < P; ++p) {
        float* row = Sh + p * N;
        const float dx = dt * x[p];
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t n = 0; n < N; ++n) {
          const float v = row[n] * decay + dx * Bg[n];
          row[n] = v;
          s += v * Cg[n];
        }
        y[p] = s + Dp[h] * x[p];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(wkvm_mamba2, m) {
  m.def(
      "decode(Tensor proj, Tensor(a!) window, Tensor conv, Tensor conv_bias, Tensor(b!) S, Tensor dt_bias, Tensor A, "
      "Tensor D, int G, bool clamp, float dt_min, float dt_max) -> Tensor",
      &decode);
}
