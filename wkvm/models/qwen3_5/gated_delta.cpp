// Gated DeltaNet's chunked delta rule for prefill (wkvm/models/qwen3_5/gated_delta.py builds this file on first use
// and keeps the torch form as its fallback and reference); everything is fp32.
//
//   chunked(S [B * Hv, dk, dv] (in/out), q, k [B, T, Hk, dk], v [B, T, Hv, dv], g, beta [B, T, Hv], chunk)
//       -> o [B, T, Hv, dv]
//     q, k, v may have any batch and token strides; each token's heads are contiguous rows. Value head h reads key
//     head h / (Hv / Hk). Per head and chunk of L tokens, with G the cumulative log-decay from the chunk's start and
//     S0 the state before it (the WY form, as the torch fallback):
//       (I + A) U = beta V,  (I + A) W = beta exp(G) K,  A_tj = beta_t exp(G_t - G_j) k_t.k_j (j < t), solved by
//       forward substitution;  Delta = U - W S0;  O = exp(G) Q S0 + P Delta,  P_tj = exp(G_t - G_j) q_t.k_j (j <= t);
//       S = exp(G_L) S0 + (exp(G_L - G) K)^T Delta.
//     Decays enter only as exp of differences G_t - G_j <= 0. The torch form spends most of its time in dispatch and
//     small batched products (0.17 s of a 1.2 s 1,024-token prefill at bench/gdn_speed.py's shape, AMD EPYC Zen 4,
//     2 threads; 0.08 s here): each thread takes a key head's value heads through all chunks, the state and the
//     chunk's rows in its own cache.
//
//   decode(proj [B, conv_dim + Hv dv + 2 Hv] (rows contiguous), window [B, conv_dim, K-1] (in/out), conv [conv_dim, K],
//       S [B * Hv, dk, dv] (in/out), neg_A, dt_bias [Hv], norm [dv], Hk, dk, l2_eps, rms_eps) -> o [B, Hv dv]
//     A Gated DeltaNet layer's one-token step between its two projections, in one call: proj = [q k v | z | b | a];
//     [q k v] = silu(causal conv over the window) (the window advances); q, k L2-normed per key head (q also times
//     dk^-1/2); g = neg_A softplus(a + dt_bias), beta = sigmoid(b); per value head S = e^g S, delta = beta (v -
//     S^T k), S += k delta^T, o = S^T q; then rms_norm(o) norm silu(z). In torch that was ~25 small ops a layer.
//
//   steps(proj [B, T, width] (rows contiguous, any batch and token strides), ... as decode) -> o [B, T, Hv dv]
//     T tokens a row, each with decode's arithmetic (decode is T = 1 of it): a prompt's chunk then has the bits of
//     stepping through it, so no chunking, batch or resumed state changes a token's numbers. Each thread takes value
//     heads through all T tokens, the head's state in its own cache, one pass over it a token: a token's rank-1 add
//     S += k delta^T runs in the next token's pass (the same operations on each element, in the same order).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../simd_math.h"
// (after simd_math.h, whose exp_approx it uses)
#include "../recurrent_parts.h"
#include "../small_gemm.h"

namespace {

using wkvm::check_heads;
using wkvm::exp_approx;
using wkvm::gemm;

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

at::Tensor chunked(at::Tensor& S, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, int64_t chunk) {
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, "k and v must be [B, T, H, d]");
  const int64_t B = k.size(0), T = k.size(1), Hk = k.size(2), dk = k.size(3), Hv = v.size(2), dv = v.size(3);
  TORCH_CHECK(Hk > 0 && Hv % Hk == 0, "value heads (", Hv, ") must be a multiple of key heads (", Hk, ")");
  TORCH_CHECK(chunk >= 1, "chunk must be at least 1");
  check_heads(q, B, T, Hk, dk, "q");
  check_heads(k, B, T, Hk, dk, "k");
  check_heads(v, B, T, Hv, dv, "v");
  for (const auto* x : {&g, &beta})
    TORCH_CHECK(x->scalar_type() == at::kFloat && x->device().is_cpu() && x->is_contiguous() && x->dim() == 3 &&
                    x->size(0) == B && x->size(1) == T && x->size(2) == Hv,
                "g and beta must be contiguous CPU float32 [", B, ", ", T, ", ", Hv, "]");
  TORCH_CHECK(S.scalar_type() == at::kFloat && S.is_contiguous() && S.dim() == 3 && S.size(0) == B * Hv &&
                  S.size(1) == dk && S.size(2) == dv,
              "S must be contiguous CPU float32 [", B * Hv, ", ", dk, ", ", dv, "]");
  at::Tensor out = at::empty({B, T, Hv, dv}, v.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t r = Hv / Hk, L = std::min(chunk, T);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float *Sp = S.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t qsb = q.stride(0), qst = q.stride(1), ksb = k.stride(0), kst = k.stride(1);
  const int64_t vsb = v.stride(0), vst = v.stride(1);

  // one work item: batch row b, key head kh, and its r value heads through every chunk
  at::parallel_for(0, B * Hk, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> Qc(L * dk), Kc(L * dk), KcT(dk * L), KK(L * L), QK(L * L), A(L * L), P(L * L), Tb(L * L),
        Tbg(L * L), U(L * dv), W(L * dk), Qd(L * dk), KendT(dk * L), G(L), eG(L), row(L);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / Hk, kh = item % Hk;
      for (int64_t t0 = 0; t0 < T; t0 += L) {
        const int64_t n = std::min(L, T - t0);
        for (int64_t t = 0; t < n; ++t) {  // the chunk's q and k rows, and their products (shared by the r heads)
          std::copy_n(qp + b * qsb + (t0 + t) * qst + kh * dk, dk, Qc.data() + t * dk);
          std::copy_n(kp + b * ksb + (t0 + t) * kst + kh * dk, dk, Kc.data() + t * dk);
          for (int64_t c = 0; c < dk; ++c) KcT[c * L + t] = Kc[t * dk + c];
        }
        gemm(n, n, dk, Kc.data(), dk, KcT.data(), L, KK.data(), L, 1.0f, 0.0f);
        gemm(n, n, dk, Qc.data(), dk, KcT.data(), L, QK.data(), L, 1.0f, 0.0f);
        for (int64_t h = kh * r; h < kh * r + r; ++h) {
          const float* gh = gp + (b * T + t0) * Hv + h;  // token stride Hv
          const float* bh = bp + (b * T + t0) * Hv + h;
          double cum = 0.0;
          for (int64_t t = 0; t < n; ++t) G[t] = static_cast<float>(cum += gh[t * Hv]);
          const float G_end = G[n - 1];
#pragma omp simd
          for (int64_t t = 0; t < n; ++t) eG[t] = exp_approx(G[t]);
          // decays; A (strictly lower) and P (lower incl. the diagonal, zeros above)
          for (int64_t t = 0; t < n; ++t) {
            const float Gt = G[t], bt = bh[t * Hv];
#pragma omp simd
            for (int64_t j = 0; j <= t; ++j) row[j] = exp_approx(Gt - G[j]);
            for (int64_t j = 0; j <= t; ++j) {
              A[t * L + j] = bt * row[j] * KK[t * L + j];
              P[t * L + j] = row[j] * QK[t * L + j];
            }
            std::fill(P.begin() + t * L + t + 1, P.begin() + t * L + n, 0.0f);
          }
          // (I + A)^-1 by forward substitution (row t: -A_t,<t times the rows above), then its columns times beta
          // (Tb) and beta e^G (Tbg): U = Tb V, W = Tbg K
          for (int64_t t = 0; t < n; ++t) {
            float* Tt = Tb.data() + t * L;
            if (t) gemm(1, t, t, A.data() + t * L, L, Tb.data(), L, Tt, L, -1.0f, 0.0f);
            Tt[t] = 1.0f;
            std::fill(Tt + t + 1, Tt + n, 0.0f);
          }
          for (int64_t t = 0; t < n; ++t)
            for (int64_t j = 0; j <= t; ++j) {
              const float bj = bh[j * Hv];
              Tbg[t * L + j] = Tb[t * L + j] * bj * eG[j];
              Tb[t * L + j] *= bj;
            }
          for (int64_t t = 0; t < n; ++t) std::fill(Tbg.begin() + t * L + t + 1, Tbg.begin() + t * L + n, 0.0f);
          gemm(n, dv, n, Tb.data(), L, vp + b * vsb + t0 * vst + h * dv, vst, U.data(), dv, 1.0f, 0.0f);
          gemm(n, dk, n, Tbg.data(), L, Kc.data(), dk, W.data(), dk, 1.0f, 0.0f);
          for (int64_t t = 0; t < n; ++t) {
            const float to_end = exp_approx(G_end - G[t]), e = eG[t];
#pragma omp simd
            for (int64_t c = 0; c < dk; ++c) Qd[t * dk + c] = e * Qc[t * dk + c];
            for (int64_t c = 0; c < dk; ++c) KendT[c * L + t] = to_end * Kc[t * dk + c];
          }
          float* Sh = Sp + (b * Hv + h) * dk * dv;
          float* oh = op + ((b * T + t0) * Hv + h) * dv;  // token stride Hv * dv
          gemm(n, dv, dk, W.data(), dk, Sh, dv, U.data(), dv, -1.0f, 1.0f);   // U becomes Delta = U - W S0
          gemm(n, dv, dk, Qd.data(), dk, Sh, dv, oh, Hv * dv, 1.0f, 0.0f);    // O = e^G Q S0
          gemm(n, dv, n, P.data(), L, U.data(), dv, oh, Hv * dv, 1.0f, 1.0f);   //   + P Delta
          gemm(dk, dv, n, KendT.data(), L, U.data(), dv, Sh, dv, 1.0f, exp_approx(G_end));  // S = e^G_L S0 + ...
        }
      }
    }
  });
  return out;
}

at::Tensor steps(const at::Tensor& proj, at::Tensor& window, const at::Tensor& conv, at::Tensor& S,
                 const at::Tensor& neg_A, const at::Tensor& dt_bias, const at::Tensor& norm, int64_t Hk, int64_t dk,
                 double l2_eps, double rms_eps) {
  const int64_t Hv = neg_A.numel(), dv = norm.numel(), B = proj.size(0), CD = 2 * Hk * dk + Hv * dv;
  TORCH_CHECK(Hk > 0 && Hv % Hk == 0, "value heads (", Hv, ") must be a multiple of key heads (", Hk, ")");
  const int64_t K = conv.size(1), width = CD + Hv * dv + 2 * Hv;
  wkvm::check_cpu_fp32({&proj, &window, &conv, &S, &neg_A, &dt_bias, &norm}, "steps");
  TORCH_CHECK(proj.dim() == 3 && proj.size(2) == width && proj.stride(2) == 1, "proj must be [B, T, ", width,
              "] with contiguous rows");
  wkvm::check_conv(conv, window, B, CD);
  TORCH_CHECK(S.is_contiguous() && S.numel() == B * Hv * dk * dv, "S must be contiguous [", B * Hv, ", ", dk, ", ",
              dv, "]");
  TORCH_CHECK(neg_A.is_contiguous() && dt_bias.is_contiguous() && dt_bias.numel() == Hv && norm.is_contiguous(),
              "neg_A, dt_bias and norm must be contiguous vectors");
  const int64_t T = proj.size(1), rs = wkvm::padded_row(CD), os = wkvm::padded_row(dv);
  at::Tensor mixed = at::empty({B * T, rs}, proj.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor out = at::empty({B, T, Hv * dv}, proj.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0) return out;
  const float *pp = proj.data_ptr<float>(), *cw = conv.data_ptr<float>(), *nA = neg_A.data_ptr<float>(),
              *dtb = dt_bias.data_ptr<float>(), *nw = norm.data_ptr<float>();
  float *win = window.data_ptr<float>(), *mx = mixed.data_ptr<float>(), *Sp = S.data_ptr<float>(),
        *op = out.data_ptr<float>();
  const int64_t psb = proj.stride(0), pst = proj.stride(1), r = Hv / Hk;
  wkvm::conv_silu_steps(pp, psb, pst, win, cw, nullptr, B, T, CD, K, mx, rs);  // the window advances
  at::parallel_for(0, B * T, 1, [&](int64_t i0, int64_t i1) {  // L2 norms per key head
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t h = 0; h < 2 * Hk; ++h) {
        float* row = mx + i * rs + h * dk;
        const float scale = (1.0f / std::sqrt(dot(row, row, dk) + static_cast<float>(l2_eps))) *
                            (h < Hk ? 1.0f / std::sqrt(static_cast<float>(dk)) : 1.0f);
#pragma omp simd
        for (int64_t c = 0; c < dk; ++c) row[c] *= scale;
      }
    }
  });
  at::parallel_for(0, B * Hv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> kS(dv), qS(dv), delta(dv), last_delta(dv);
    at::Tensor o_row = at::empty({os}, proj.options());  // torch's allocator: 64-byte aligned, as every row of mixed
    float* o = o_row.data_ptr<float>();
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / Hv, h = item % Hv, kh = h / r;
      float* Sh = Sp + item * dk * dv;
      const float* last_k = nullptr;  // the previous token's S += k delta^T, still to add (with this token's pass)
      for (int64_t t = 0; t < T; ++t) {
        const float* x = pp + b * psb + t * pst;
        const float* m = mx + (b * T + t) * rs;
        const float* q = m + kh * dk;
        const float* k = m + Hk * dk + kh * dk;
        const float* v = m + 2 * Hk * dk + h * dv;
        const float* z = x + CD + h * dv;
        const float a = x[CD + Hv * dv + Hv + h] + dtb[h];
        const float g = nA[h] * wkvm::softplus(a);
        const float beta = 1.0f / (1.0f + std::exp(-x[CD + Hv * dv + h]));
        const float decay = std::exp(g);
        std::fill(kS.begin(), kS.end(), 0.0f);
        std::fill(qS.begin(), qS.end(), 0.0f);
        for (int64_t i = 0; i < dk; ++i) {  // S = e^g S, and the decayed S's k^T S and q^T S in the same pass
          float* row = Sh + i * dv;
          const float ki = k[i], qi = q[i];
          if (last_k != nullptr) {  // the previous token's rank-1 add first: one pass over S a token, not two
            const float lk = last_k[i];
            const float* ld = last_delta.data();
#pragma omp simd
            for (int64_t c = 0; c < dv; ++c) {
              const float added = row[c] + lk * ld[c];
              const float s = added * decay;
              row[c] = s;
              kS[c] += ki * s;
              qS[c] += qi * s;
            }
          } else {
#pragma omp simd
            for (int64_t c = 0; c < dv; ++c) {
              const float s = row[c] * decay;
              row[c] = s;
              kS[c] += ki * s;
              qS[c] += qi * s;
            }
          }
        }
        const float qk = dot(q, k, dk);
#pragma omp simd
        for (int64_t c = 0; c < dv; ++c) {
          delta[c] = (v[c] - kS[c]) * beta;
          o[c] = qS[c] + delta[c] * qk;
        }
        std::swap(delta, last_delta);
        last_k = k;
        const float inv = 1.0f / std::sqrt(dot(o, o, dv) / static_cast<float>(dv) + static_cast<float>(rms_eps));
        float* ot = op + ((b * T + t) * Hv + h) * dv;
#pragma omp simd
        for (int64_t c = 0; c < dv; ++c) ot[c] = o[c] * inv * nw[c] * wkvm::silu_approx(z[c]);
      }
      for (int64_t i = 0; i < dk; ++i) {  // the last token's S += k delta^T
        float* row = Sh + i * dv;
        const float lk = last_k[i];
#pragma omp simd
        for (int64_t c = 0; c < dv; ++c) row[c] += lk * last_delta[c];
      }
    }
  });
  return out;
}

at::Tensor decode(const at::Tensor& proj, at::Tensor& window, const at::Tensor& conv, at::Tensor& S,
                  const at::Tensor& neg_A, const at::Tensor& dt_bias, const at::Tensor& norm, int64_t Hk, int64_t dk,
                  double l2_eps, double rms_eps) {
  TORCH_CHECK(proj.dim() == 2 && proj.stride(1) == 1, "proj must be [B, width] with contiguous rows");
  at::Tensor o = steps(proj.unsqueeze(1), window, conv, S, neg_A, dt_bias, norm, Hk, dk, l2_eps, rms_eps);
  return o.view({o.size(0), o.size(2)});
}

}  // namespace

TORCH_LIBRARY(wkvm_gdn, m) {
  m.def("chunked(Tensor(a!) S, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, int chunk) -> Tensor", &chunked);
  m.def(
      "decode(Tensor proj, Tensor(a!) window, Tensor conv, Tensor(b!) S, Tensor neg_A, Tensor dt_bias, Tensor norm, "
      "int Hk, int dk, float l2_eps, float rms_eps) -> Tensor",
      &decode);
  m.def(
      "steps(Tensor proj, Tensor(a!) window, Tensor conv, Tensor(b!) S, Tensor neg_A, Tensor dt_bias, Tensor norm, "
      "int Hk, int dk, float l2_eps, float rms_eps) -> Tensor",
      &steps);
}
