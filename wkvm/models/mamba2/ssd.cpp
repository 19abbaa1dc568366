// Mamba2's mixer between its two projections (wkvm/models/mamba2/ssd.py builds this file on first use and keeps the
// torch ops as fallback and as the reference in tests); everything is fp32.
//
//   steps(proj [b, T, d_inner + conv_dim + H] (rows contiguous, any batch and token strides; z is not read), window
//       [b, conv_dim, K-1] (in/out), conv [conv_dim, K], conv_bias [conv_dim], S [b, H, P, N] (in/out), dt_bias, A,
//       D [H], G, clamp, dt_min, dt_max) -> y [b, T, H P]
//     For each token, in order: [x B C] = silu(causal conv over the window + bias) (the window advances); dt =
//     softplus(dt + dt_bias), clamped to [dt_min, dt_max] when `clamp`; per head h (group g = h / (H / G)) and row p
//     of its state: S[p] = e^(dt A) S[p] + dt x[p] B_g,  y[p] = S[p] . C_g + D x[p].
//     A decode step is T = 1; a prompt's chunk of T tokens runs the same arithmetic token after token, so it has the
//     bits of stepping through it and no chunking, batch or resumed state changes a token's numbers. Each thread
//     takes heads through all T tokens, the head's state in its own cache. One pass over the state a token: at 32
//     sequences the state (19 MB a sequence at the 130m shape), not the weights, is what a decode step streams, and
//     the torch ops' three passes (scale, rank-1 add, read out) took 161 ms of a 247 ms step there (AMD EPYC Zen 4,
//     2 threads).
//
//   chunked(S [b, H, P, N] (in/out), x [b, T, H, P], dt [b, T, H], A [H], B, C [b, T, G, N], D [H], chunk)
//       -> y [b, T, H, P]
//     The chunked SSD form of ssd.py's `ssd_chunked` (its torch ops are the fallback and the reference in tests):
//     per chunk of L tokens, with cum the cumulative dt A from the chunk's start, y = ((C B^T) * e^(cum_t - cum_j),
//     j <= t) (dt x) + e^cum (C S^T) + D x, then S = e^cum_L S + (e^(cum_L - cum) dt x)^T B. x, B and C may have any
//     batch and token strides; each token's heads are contiguous rows. C B^T is computed once per group and chunk,
//     then each thread takes heads through all chunks, the state and the chunk's rows in its own cache.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../simd_math.h"
// (after simd_math.h, whose exp_approx it uses)
#include "../recurrent_parts.h"
#include "../small_gemm.h"

namespace {

at::Tensor steps(const at::Tensor& proj, at::Tensor& window, const at::Tensor& conv, const at::Tensor& conv_bias,
                 at::Tensor& S, const at::Tensor& dt_bias, const at::Tensor& A, const at::Tensor& D, int64_t G,
                 bool clamp, double dt_min, double dt_max) {
  const int64_t b = S.size(0), H = S.size(1), P = S.size(2), N = S.size(3), d_inner = H * P;
  const int64_t CD = d_inner + 2 * G * N, K = conv.size(1), width = d_inner + CD + H;
  wkvm::check_cpu_fp32({&proj, &window, &conv, &conv_bias, &S, &dt_bias, &A, &D}, "steps");
  TORCH_CHECK(G > 0 && H % G == 0, "heads (", H, ") must be a multiple of groups (", G, ")");
  TORCH_CHECK(S.is_contiguous() && S.dim() == 4, "S must be contiguous [b, H, P, N]");
  TORCH_CHECK(proj.dim() == 3 && proj.size(0) == b && proj.size(2) == width && proj.stride(2) == 1,
              "proj must be [", b, ", T, ", width, "] with contiguous rows");
  wkvm::check_conv(conv, window, b, CD);
  TORCH_CHECK(conv_bias.is_contiguous() && conv_bias.numel() == CD && dt_bias.is_contiguous() &&
                  dt_bias.numel() == H && A.is_contiguous() && A.numel() == H && D.is_contiguous() && D.numel() == H,
              "conv_bias [", CD, "], dt_bias, A and D [", H, "] must be contiguous");
  const int64_t T = proj.size(1), rs = wkvm::padded_row(CD);
  at::Tensor mixed = at::empty({b * T, rs}, proj.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor out = at::empty({b, T, d_inner}, proj.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0) return out;
  const float *pp = proj.data_ptr<float>(), *cw = conv.data_ptr<float>(), *cb = conv_bias.data_ptr<float>();
  const float *dtb = dt_bias.data_ptr<float>(), *Ap = A.data_ptr<float>(), *Dp = D.data_ptr<float>();
  float *win = window.data_ptr<float>(), *mx = mixed.data_ptr<float>(), *Sp = S.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t psb = proj.stride(0), pst = proj.stride(1), hpg = H / G;
  wkvm::conv_silu_steps(pp + d_inner, psb, pst, win, cw, cb, b, T, CD, K, mx, rs);  // the window advances
  at::parallel_for(0, b * H, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t r = item / H, h = item % H, g = h / hpg;
      float* Sh = Sp + item * P * N;
      for (int64_t t = 0; t < T; ++t) {
        const float a = pp[r * psb + t * pst + d_inner + CD + h] + dtb[h];
        float dt = wkvm::softplus(a);
        if (clamp) dt = std::min(std::max(dt, static_cast<float>(dt_min)), static_cast<float>(dt_max));
        const float decay = std::exp(dt * Ap[h]);
        const float* m = mx + (r * T + t) * rs;
        const float* x = m + h * P;
        const float* Bg = m + d_inner + g * N;
        const float* Cg = m + d_inner + G * N + g * N;
        float* y = op + ((r * T + t) * H + h) * P;
        int64_t p = 0;
        for (; p < P; ++p) {
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
    }
  });
  return out;
}

at::Tensor chunked(at::Tensor& S, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                   const at::Tensor& C, const at::Tensor& D, int64_t chunk) {
  TORCH_CHECK(S.scalar_type() == at::kFloat && S.is_contiguous() && S.dim() == 4, "S must be contiguous [b, H, P, N]");
  const int64_t b = S.size(0), H = S.size(1), P = S.size(2), N = S.size(3), T = x.size(1), G = B.size(2);
  TORCH_CHECK(G > 0 && H % G == 0, "heads (", H, ") must be a multiple of groups (", G, ")");
  TORCH_CHECK(chunk >= 1, "chunk must be at least 1");
  wkvm::check_heads(x, b, T, H, P, "x");
  wkvm::check_heads(B, b, T, G, N, "B");
  wkvm::check_heads(C, b, T, G, N, "C");
  TORCH_CHECK(dt.scalar_type() == at::kFloat && dt.is_contiguous() && dt.dim() == 3 && dt.size(0) == b &&
                  dt.size(1) == T && dt.size(2) == H,
              "dt must be contiguous [", b, ", ", T, ", ", H, "]");
  TORCH_CHECK(A.scalar_type() == at::kFloat && A.is_contiguous() && A.numel() == H && D.scalar_type() == at::kFloat &&
                  D.is_contiguous() && D.numel() == H,
              "A and D must be contiguous float32 [", H, "]");
  at::Tensor out = at::empty({b, T, H, P}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0) return out;
  const int64_t L = std::min(chunk, T), chunks = (T + L - 1) / L, hpg = H / G;
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>(), *Dp = D.data_ptr<float>();
  float *Sp = S.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t xsb = x.stride(0), xst = x.stride(1), Bsb = B.stride(0), Bst = B.stride(1);
  const int64_t Csb = C.stride(0), Cst = C.stride(1);
  // C B^T per batch row, group and chunk, shared by the group's heads
  std::vector<float> CB(b * G * chunks * L * L);
  at::parallel_for(0, b * G * chunks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> Cc(L * N), BT(N * L);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t r = item / (G * chunks), g = item / chunks % G, c = item % chunks;
      const int64_t t0 = c * L, n = std::min(L, T - t0);
      for (int64_t t = 0; t < n; ++t) {
        std::copy_n(Cp + r * Csb + (t0 + t) * Cst + g * N, N, Cc.data() + t * N);
        const float* Bt = Bp + r * Bsb + (t0 + t) * Bst + g * N;
        for (int64_t k = 0; k < N; ++k) BT[k * L + t] = Bt[k];
      }
      wkvm::gemm(n, n, N, Cc.data(), N, BT.data(), L, CB.data() + item * L * L, L, 1.0f, 0.0f);
    }
  });
  at::parallel_for(0, b * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> cum(L), row(L), scores(L * L), dtx(L * P), Bc(L * N), CdT(N * L), YsT(P * L), WT(P * L);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t r = item / H, h = item % H, g = h / hpg;
      float* Sh = Sp + item * P * N;  // [P, N]
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t t0 = c * L, n = std::min(L, T - t0);
        const float* dth = dtp + (r * T + t0) * H + h;  // token stride H
        double acc = 0.0;
        for (int64_t t = 0; t < n; ++t) cum[t] = static_cast<float>(acc += double(dth[t * H]) * Ap[h]);
        const float cum_end = cum[n - 1];
        for (int64_t t = 0; t < n; ++t) {
          const float* xt = xp + r * xsb + (t0 + t) * xst + h * P;
          const float d = dth[t * H], to_end = wkvm::exp_approx(cum_end - cum[t]), e = wkvm::exp_approx(cum[t]);
#pragma omp simd
          for (int64_t p = 0; p < P; ++p) dtx[t * P + p] = xt[p] * d;
          for (int64_t p = 0; p < P; ++p) WT[p * L + t] = dtx[t * P + p] * to_end;
          const float* Ct = Cp + r * Csb + (t0 + t) * Cst + g * N;
          for (int64_t k = 0; k < N; ++k) CdT[k * L + t] = e * Ct[k];
          std::copy_n(Bp + r * Bsb + (t0 + t) * Bst + g * N, N, Bc.data() + t * N);
          const float* cb = CB.data() + ((r * G + g) * chunks + c) * L * L + t * L;
          const float ct = cum[t];
#pragma omp simd
          for (int64_t j = 0; j <= t; ++j) row[j] = wkvm::exp_approx(ct - cum[j]);
          for (int64_t j = 0; j <= t; ++j) scores[t * L + j] = row[j] * cb[j];
          std::fill(scores.begin() + t * L + t + 1, scores.begin() + t * L + n, 0.0f);
        }
        float* yh = op + ((r * T + t0) * H + h) * P;  // token stride H * P
        wkvm::gemm(n, P, n, scores.data(), L, dtx.data(), P, yh, H * P, 1.0f, 0.0f);  // within the chunk
        wkvm::gemm(P, n, N, Sh, N, CdT.data(), L, YsT.data(), L, 1.0f, 0.0f);         // S0 read through C
        for (int64_t t = 0; t < n; ++t) {
          float* yt = yh + t * H * P;
          const float* xt = xp + r * xsb + (t0 + t) * xst + h * P;
          for (int64_t p = 0; p < P; ++p) yt[p] += YsT[p * L + t] + Dp[h] * xt[p];
        }
        wkvm::gemm(P, N, n, WT.data(), L, Bc.data(), N, Sh, N, 1.0f, wkvm::exp_approx(cum_end));  // the state
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(wkvm_mamba2, m) {
  m.def(
      "steps(Tensor proj, Tensor(a!) window, Tensor conv, Tensor conv_bias, Tensor(b!) S, Tensor dt_bias, Tensor A, "
      "Tensor D, int G, bool clamp, float dt_min, float dt_max) -> Tensor",
      &steps);
  m.def("chunked(Tensor(a!) S, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, int chunk) -> Tensor",
        &chunked);
}
