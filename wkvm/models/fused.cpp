// Fused per-layer ops for decode-sized steps (issues #16, #21): each replaces a chain of small torch ops whose
// dispatch, not arithmetic, dominates a one-token step. wkvm/models/fused.py builds this file on first use (like
// the int8/int4 kernels) and keeps a torch fallback for each op; every op computes in fp32.
//
//   rms_norm(x [N, C], w [C], eps)            -> x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm(x [N, C], a [N, C], w, eps)  -> (x + a, rms_norm(x + a))
//   silu_mul(gu [N, 2F])                      -> silu(gu[:, :F]) * gu[:, F:]
//   rope_attend(q [B, Hq, D], k, v [B, Hkv, D], cos, sin [B, R], kflat, vflat [S, Hkv, D], table [B, P] int64,
//               lengths [B] int64, page_tokens, scale) -> [B, Hq, D]
//     One new token per row: RoPE (HF half-split pairs over the first R dims) on q and k, k and v written to the
//     row's slot at position lengths[b] (slot = table[b][pos / page_tokens] * page_tokens + pos % page_tokens),
//     then grouped-query attention of q over the row's lengths[b] + 1 cached tokens, read page by page in place
//     (query head h uses kv head h / (Hq / Hkv), HF's repeat_kv order). Work items are (row, kv head) pairs on
//     torch's thread pool; each writes only its own slot's head, so rows never race.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

// e^x (x clamped to [-87, 88]): Cody-Waite reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial (relative
// error < 2e-7), times 2^n built in the exponent bits; written so the compiler vectorizes it (std::exp is not).
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // by value: std::min/max's references defeat the vectorizer
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), name, " must be a CPU float32 tensor");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [N, C] with contiguous rows");
}

inline void norm_row(const float* x, const float* w, float* y, int64_t C, float eps) {
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
    for (int64_t r = r0; r < r1; ++r) {
      float* row = ps + r * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) row[c] = px[r * sx + c] + pa[r * sa + c];
      norm_row(row, pw, py + r * C, C, static_cast<float>(eps));
    }
  });
  return {s, y};
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
      const float *g = pg + r * sg, *u = g + F;
      float* out = py + r * F;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) out[c] = g[c] / (1.0f + exp_approx(-g[c])) * u[c];
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
  // f(first token, token count, the first token's slot) for each page holding tokens 0..n-1
  template <class F>
  void each(int64_t n, const F& f) const {
    for (int64_t t0 = 0, p = 0; t0 < n; t0 += page_tokens, ++p) f(t0, std::min(page_tokens, n - t0), table[p] * page_tokens);
  }
};

// scores[g * n + t] = q_g . k_t for the row's n tokens (q already scaled), four tokens at a time so that four
// independent sums run per query head.
void scores_of(const float* qr, const float* kf, const Pages& pg, int64_t n, int64_t G, int64_t D, int64_t HD,
               int64_t head, float* scores) {
  pg.each(n, [&](int64_t t0, int64_t count, int64_t slot) {
    const float* kp = kf + slot * HD + head;
    int64_t i = 0;
    for (; i + 4 <= count; i += 4) {
      const float *k0 = kp + i * HD, *k1 = k0 + HD, *k2 = k1 + HD, *k3 = k2 + HD;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qr + g * D;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t d = 0; d < D; ++d) {
          s0 += qg[d] * k0[d];
          s1 += qg[d] * k1[d];
          s2 += qg[d] * k2[d];
          s3 += qg[d] * k3[d];
        }
        float* sg = scores + g * n + t0 + i;
        sg[0] = s0, sg[1] = s1, sg[2] = s2, sg[3] = s3;
      }
    }
    for (; i < count; ++i) {
      const float* kt = kp + i * HD;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qr + g * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qg[d] * kt[d];
        scores[g * n + t0 + i] = s;
      }
    }
  });
}

// acc[g] = sum_t p[g * n + t] v_t, four tokens at a time (one load and store of acc per four tokens).
void values_of(const float* p, const float* vf, const Pages& pg, int64_t n, int64_t G, int64_t D, int64_t HD,
               int64_t head, float* acc) {
  std::fill(acc, acc + G * D, 0.f);
  pg.each(n, [&](int64_t t0, int64_t count, int64_t slot) {
    const float* vp = vf + slot * HD + head;
    int64_t i = 0;
    for (; i + 4 <= count; i += 4) {
      const float *v0 = vp + i * HD, *v1 = v0 + HD, *v2 = v1 + HD, *v3 = v2 + HD;
      for (int64_t g = 0; g < G; ++g) {
        const float* pt = p + g * n + t0 + i;
        const float p0 = pt[0], p1 = pt[1], p2 = pt[2], p3 = pt[3];
        float* __restrict a = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
      }
    }
    for (; i < count; ++i) {
      const float* vt = vp + i * HD;
      for (int64_t g = 0; g < G; ++g) {
        const float pt = p[g * n + t0 + i];
        float* __restrict a = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += pt * vt[d];
      }
    }
  });
}

void softmax_rows(float* scores, int64_t G, int64_t n) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    float m = sg[0];
    for (int64_t t = 1; t < n; ++t) m = std::max(m, sg[t]);
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) sg[t] = exp_approx(sg[t] - m);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) sum += sg[t];
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
  }
}

// [B, H, D] or [B, 1, H, D] with each row's heads contiguous: the row stride
int64_t row_stride(const at::Tensor& t, int64_t H, int64_t D, const char* name) {
  const bool ok = t.scalar_type() == at::kFloat && t.device().is_cpu() && t.size(-1) == D && t.size(-2) == H &&
                  t.stride(-1) == 1 && t.stride(-2) == D && (t.dim() == 3 || (t.dim() == 4 && t.size(1) == 1));
  TORCH_CHECK(ok, name, " must be a CPU float32 [B, H, D] or [B, 1, H, D] tensor with contiguous heads");
  return t.stride(0);
}

at::Tensor rope_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& kflat, const at::Tensor& vflat,
                       const at::Tensor& table, const at::Tensor& lengths, int64_t page_tokens, double scale) {
  TORCH_CHECK(q.dim() >= 3 && k.dim() >= 3, "q and k must be [B, H, D] or [B, 1, H, D]");
  const int64_t B = q.size(0), Hq = q.size(-2), D = q.size(-1), Hkv = k.size(-2), R = cos.size(-1);
  const int64_t sq = row_stride(q, Hq, D, "q"), sk = row_stride(k, Hkv, D, "k"), sv = row_stride(v, Hkv, D, "v");
  TORCH_CHECK(k.size(0) == B && v.size(0) == B, "q, k and v must have the same rows");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of key/value heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.numel() == B * R && sin.numel() == B * R && R % 2 == 0 &&
                  R <= D,
              "cos and sin must be contiguous float32 [B, R] (or [B, 1, 1, R]) with R even and at most D");
  for (const at::Tensor* t : {&kflat, &vflat}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(1) == Hkv &&
                    t->size(2) == D,
                "the KV pools must be contiguous float32 [slots, Hkv, D]");
  }
  TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous() && table.dim() == 2 && table.size(0) == B,
              "table must be int64 [B, pages]");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == B,
              "lengths must be int64 [B]");
  TORCH_CHECK(page_tokens > 0, "page_tokens must be positive");
  const int64_t P = table.size(1), S = kflat.size(0), G = Hq / Hkv;
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
  std::vector<int64_t> shape(q.sizes().begin(), q.sizes().end());
  at::Tensor out = at::empty(shape, q.options());
  const float *pq = q.data_ptr<float>(), *pk = k.data_ptr<float>(), *pv = v.data_ptr<float>();
  const float *pc = cos.data_ptr<float>(), *ps = sin.data_ptr<float>();
  float *kf = kflat.data_ptr<float>(), *vf = vflat.data_ptr<float>(), *po = out.data_ptr<float>();
  const int64_t HD = Hkv * D;
  const float fscale = static_cast<float>(scale);
  // the new token's key and value first (each work item below reads every token of its row and head)
  for (int64_t b = 0; b < B; ++b) {
    const int64_t slot = Pages{pt + b * P, page_tokens}.slot(pl[b]);
    for (int64_t j = 0; j < Hkv; ++j) rope(pk + b * sk + j * D, pc + b * R, ps + b * R, kf + slot * HD + j * D, D, R, 1.f);
    std::memcpy(vf + slot * HD, pv + b * sv, HD * sizeof(float));
  }
  int64_t tokens = 0;  // threads only for enough work: waking them costs more than a short cache's attention
  for (int64_t b = 0; b < B; ++b) tokens += pl[b] + 1;
  const int64_t grain = std::max<int64_t>(1, 4096 * B / std::max<int64_t>(1, tokens * G));
  at::parallel_for(0, B * Hkv, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> qr(G * D), acc(G * D), scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Hkv, j = i % Hkv, n = pl[b] + 1;
      const Pages pg{pt + b * P, page_tokens};
      for (int64_t g = 0; g < G; ++g) rope(pq + b * sq + (j * G + g) * D, pc + b * R, ps + b * R, qr.data() + g * D, D, R, fscale);
      scores.resize(G * n);
      scores_of(qr.data(), kf, pg, n, G, D, HD, j * D, scores.data());
      softmax_rows(scores.data(), G, n);
      values_of(scores.data(), vf, pg, n, G, D, HD, j * D, acc.data());
      std::memcpy(po + b * Hq * D + j * G * D, acc.data(), G * D * sizeof(float));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(wkvm_fused, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor a, Tensor w, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("silu_mul(Tensor gu) -> Tensor", &silu_mul);
  m.def(
      "rope_attend(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) kflat, Tensor(b!) vflat, "
      "Tensor table, Tensor lengths, int page_tokens, float scale) -> Tensor",
      &rope_attend);
}
