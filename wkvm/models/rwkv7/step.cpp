// RWKV-7 decode-step ops (issue #21): one token per row, so each op below replaces a chain of small torch ops whose
// dispatch, not arithmetic, was most of a layer's time. wkvm/models/rwkv7/step.py builds this file on first use and
// keeps a torch fallback for each op; everything is fp32. Rows are [B, C] with contiguous rows (any row stride).
//
//   norm_shift_mix(x, add?, ln_w, ln_b, eps, shift (in/out), mix [M, C], tokens = T) -> (s = x + add,
//       mixed [M, B * T, C]): xx = layer_norm(s); mixed[m] = xx + (shift - xx) * mix[m]; then shift = xx (token
//     shift of one step), token by token for T tokens of each row of shift (rows b * T .. b * T + T - 1 of x).
//   loras(xs[], firsts[] [C, R], seconds[] [R, C], biases?[] [C], inner[], outer[]) -> ys[] [B, C]
//     ys[j] = outer_j(bias_j + inner_j(xs[j] @ firsts[j]) @ seconds[j]); activations 0 none, 1 tanh, 2 sigmoid.
//     Chains run in parallel (the four LoRAs of a layer read ~1.8 MB of weights at the 0.1B shape).
//   wkv(S [B, H, N, N] (in/out), r, decay, k, v, v_first, v_mix?, a, g, k_k, k_a, r_k [H, N], ln_w, ln_b, gn_eps,
//       tokens = T) -> (out [B * T, C], v): the time mix after its matmuls, for T tokens of each row of S in order
//     (rows b * T .. b * T + T - 1 of the inputs: prefill runs the decode step's arithmetic token by token).
//     kk = normalize(k * k_k) per head; k' = k (1 + (a - 1) k_a); v' = v + (v_first - v) v_mix (v when v_mix is
//     absent: layer 0); w = exp(-0.606531 decay); per head
//     S = S diag(w) + (S (-kk)) (kk a)^T + v' k'^T, o = S r; out = (group_norm(o) + (r . (k' r_k)) v') * g.
//   relu_square(x) -> relu(x)^2
//   layer(x, v_first, att_shift, S, ffn_shift, w[], kernel, args, ln_eps, gn_eps, tokens = T) -> (x, v_first): a
//     whole layer for T tokens of each row of the states, with the bits of T one-token calls.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../linear_call.h"
#include "../simd_math.h"

namespace {

using wkvm::exp_approx;

constexpr float kDecayScale = 0.606531f;  // exp(-0.5), as in BlinkDL's reference

// tanh(x) = 1 - 2 / (e^2x + 1); for |x| < 0.05 the series (cancellation would cost relative precision there)
inline float tanh_approx(float x) {
  const float t = 1.0f - 2.0f / (exp_approx(2.0f * x) + 1.0f);
  const float x2 = x * x;
  return (x2 < 2.5e-3f) ? x * (1.0f - x2 * (1.0f / 3.0f - x2 * (2.0f / 15.0f))) : t;
}

inline float sigmoid_approx(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

void activate(float* y, int64_t n, int64_t act) {
  if (act == 1) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = tanh_approx(y[i]);
  } else if (act == 2) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = sigmoid_approx(y[i]);
  }
}

void check_rows(const at::Tensor& x, int64_t B, int64_t C, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), name, " must be a CPU float32 tensor");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == B && x.size(1) == C && x.stride(1) == 1, name, " must be [", B, ", ", C,
              "] with contiguous rows");
}

void check_vector(const at::Tensor& x, int64_t C, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.is_contiguous() && x.numel() == C, name,
              " must be a contiguous CPU float32 tensor of ", C, " values");
}

// `tokens` tokens of each row of shift (x, add [B * tokens, C], row b's tokens in order): each token's shift is the
// one before it, as `tokens` calls of one token each.
std::tuple<at::Tensor, at::Tensor> norm_shift_mix(const at::Tensor& x, const std::optional<at::Tensor>& add,
                                                  const at::Tensor& ln_w, const at::Tensor& ln_b, double eps,
                                                  const at::Tensor& shift, const at::Tensor& mix, int64_t tokens) {
  TORCH_CHECK(tokens >= 1, "tokens must be at least 1");
  const int64_t T = tokens, B = shift.size(0), C = x.size(-1), M = mix.size(0);
  check_rows(x, B * T, C, "x");
  check_rows(shift, B, C, "shift");
  if (add) check_rows(*add, B * T, C, "add");
  check_vector(ln_w, C, "ln_w");
  check_vector(ln_b, C, "ln_b");
  check_vector(mix, M * C, "mix");
  at::Tensor s = at::empty({B * T, C}, x.options()), mixed = at::empty({M, B * T, C}, x.options());
  const float *px = x.data_ptr<float>(), *pa = add ? add->data_ptr<float>() : nullptr;
  const float *pw = ln_w.data_ptr<float>(), *pb = ln_b.data_ptr<float>(), *pm = mix.data_ptr<float>();
  float *ps = s.data_ptr<float>(), *pmixed = mixed.data_ptr<float>(), *pshift = shift.data_ptr<float>();
  const int64_t sx = x.stride(0), sa = add ? add->stride(0) : 0, ssh = shift.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> xx(C);
    for (int64_t bt = b0 * T; bt < b1 * T; ++bt) {
      const int64_t b = bt;  // the input row (token bt % T of shift row bt / T)
      float* row = ps + b * C;
      float* sh = pshift + (bt / T) * ssh;
      if (pa) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) row[c] = px[b * sx + c] + pa[b * sa + c];
      } else {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) row[c] = px[b * sx + c];
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < C; ++c) sum += row[c];
      const float mean = sum / static_cast<float>(C);
      float var = 0.f;
#pragma omp simd reduction(+ : var)
      for (int64_t c = 0; c < C; ++c) var += (row[c] - mean) * (row[c] - mean);
      const float inv = 1.0f / std::sqrt(var / static_cast<float>(C) + feps);
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) xx[c] = (row[c] - mean) * inv * pw[c] + pb[c];
      for (int64_t m = 0; m < M; ++m) {
        float* out = pmixed + (m * B * T + b) * C;
        const float* mm = pm + m * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) out[c] = xx[c] + (sh[c] - xx[c]) * mm[c];
      }
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) sh[c] = xx[c];
    }
  });
  return {s, mixed};
}

// vrow: a vector of the CPU's register width (16 floats with AVX-512, 8 with AVX2). A 16-float vector is two AVX2
// registers, and the kernels' sums spilled with it: a batch-32 decode step's wkv took 3-4x, a 1,024-token
// prefill's 7x AVX-512's time. hsum_row reduces one in a fixed order.
typedef float v4f __attribute__((vector_size(16)));
#ifdef __AVX512F__
typedef float vrow __attribute__((vector_size(64)));
inline float hsum_row(vrow v) {
  typedef float v8f __attribute__((vector_size(32)));
  const v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
#else
typedef float vrow __attribute__((vector_size(32)));
inline float hsum_row(vrow v) {
  const v4f b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
#endif
constexpr int64_t kRowWidth = sizeof(vrow) / sizeof(float);

inline vrow load_row(const float* p) {
  vrow v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// out[b, n] = init[n] (0 without init) + sum over k in order of lhs[b, k] rhs[k, n], one fused multiply-add per
// k, for rows 0..BB-1 and columns 0..NV W-1 of the pointers given (offset to the tile): the tile's sums stay in
// registers, each operand row is read once per tile.
template <int BB, int NV>
void product_tile(const float* lhs, int64_t ldl, const float* rhs, int64_t ldr, int64_t K, const float* init,
                  float* out, int64_t ldo) {
  constexpr int64_t W = kRowWidth;
  vrow acc[BB][NV];
  for (int i = 0; i < BB; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = init ? load_row(init + v * W) : vrow{};
  for (int64_t k = 0; k < K; ++k) {
    vrow w[NV];
    for (int v = 0; v < NV; ++v) w[v] = load_row(rhs + k * ldr + v * W);
    for (int i = 0; i < BB; ++i) {
      const float a = lhs[i * ldl + k];
      for (int v = 0; v < NV; ++v) acc[i][v] += a * w[v];
    }
  }
  for (int i = 0; i < BB; ++i)
    for (int v = 0; v < NV; ++v) std::memcpy(out + i * ldo + v * W, &acc[i][v], sizeof(vrow));
}

// out [B, N] = init + lhs [B, K] @ rhs [K, N] (rows ldl, ldr, ldo apart) in register tiles: kLoraRows rows x 4
// vectors, single rows (B's remainder, or B = 1) 8 vectors wide so that enough sums advance side by side; every
// element is the same sequence of fused multiply-adds whatever its tile (a row's bits do not depend on B).
#ifdef __AVX512F__
constexpr int kLoraRows = 4;  // 16 sums + 4 operand vectors of 32 registers
#else
constexpr int kLoraRows = 2;  // 8 + 4 of 16
#endif

struct Product {
  const float* lhs;
  int64_t ldl;
  const float* rhs;
  int64_t ldr, K, N;
  const float* init;  // [N] or nullptr (zeros)
  float* out;
  int64_t ldo;
};

template <int BB, int NV>
int64_t tiles(const Product& p, int64_t b, int64_t n) {  // rows b..b+BB-1 from column n while NV vectors fit
  constexpr int64_t W = kRowWidth;
  for (; n + NV * W <= p.N; n += NV * W)
    product_tile<BB, NV>(p.lhs + b * p.ldl, p.ldl, p.rhs + n, p.ldr, p.K, p.init ? p.init + n : nullptr,
                         p.out + b * p.ldo + n, p.ldo);
  return n;
}

template <int BB>
void rows(const Product& p, int64_t b) {  // rows b..b+BB-1, every column
  constexpr int WIDE = BB == 1 ? 8 : 4;
  int64_t n = tiles<BB, WIDE>(p, b, 0);
  if constexpr (WIDE > 4) n = tiles<BB, 4>(p, b, n);
  n = tiles<BB, 1>(p, b, n);
  for (; n < p.N; ++n)
    for (int64_t i = b; i < b + BB; ++i) {
      float acc = p.init ? p.init[n] : 0.f;
      for (int64_t k = 0; k < p.K; ++k) acc += p.lhs[i * p.ldl + k] * p.rhs[k * p.ldr + n];
      p.out[i * p.ldo + n] = acc;
    }
}

void product(const Product& p, int64_t B) {
  int64_t b = 0;
  for (; b + kLoraRows <= B; b += kLoraRows) rows<kLoraRows>(p, b);
  for (; b < B; ++b) rows<1>(p, b);
}

// y [B, C] = outer(bias + inner(x [B, C] @ A [C, R]) @ Bm [R, C]), both products in register tiles (`product`).
void lora_chain(const at::Tensor& x, const at::Tensor& A, const at::Tensor& Bm, const float* bias, int64_t inner,
                int64_t outer, float* y) {
  const int64_t B = x.size(0), C = x.size(1), R = A.size(1), sx = x.stride(0);
  const float *px = x.data_ptr<float>(), *pA = A.data_ptr<float>(), *pB = Bm.data_ptr<float>();
  std::vector<float> h(B * R);
  product({px, sx, pA, R, C, R, nullptr, h.data(), R}, B);
  activate(h.data(), B * R, inner);
  product({h.data(), R, pB, C, R, C, bias, y, C}, B);
  activate(y, B * C, outer);
}

std::vector<at::Tensor> loras(at::TensorList xs, at::TensorList firsts, at::TensorList seconds,
                              const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef inner,
                              at::IntArrayRef outer) {
  const int64_t J = static_cast<int64_t>(xs.size());
  TORCH_CHECK(J > 0 && firsts.size() == xs.size() && seconds.size() == xs.size() &&
                  static_cast<int64_t>(biases.size()) == J && static_cast<int64_t>(inner.size()) == J &&
                  static_cast<int64_t>(outer.size()) == J,
              "loras: one x, first, second, bias and two activations per chain");
  std::vector<at::Tensor> ys;
  for (int64_t j = 0; j < J; ++j) {
    const at::Tensor &x = xs[j], &A = firsts[j], &Bm = seconds[j];
    TORCH_CHECK(x.dim() == 2, "loras: x must be [B, C]");
    const int64_t B = x.size(0), C = x.size(1);
    check_rows(x, B, C, "x");
    TORCH_CHECK(A.scalar_type() == at::kFloat && A.is_contiguous() && A.dim() == 2 && A.size(0) == C,
                "loras: first must be a contiguous float32 [C, R]");
    TORCH_CHECK(Bm.scalar_type() == at::kFloat && Bm.is_contiguous() && Bm.dim() == 2 && Bm.size(0) == A.size(1) &&
                    Bm.size(1) == C,
                "loras: second must be a contiguous float32 [R, C]");
    const std::optional<at::Tensor> bias = biases.get(j);
    if (bias) check_vector(*bias, C, "bias");
    TORCH_CHECK(inner[j] >= 0 && inner[j] <= 2 && outer[j] >= 0 && outer[j] <= 2, "loras: activations are 0, 1, 2");
    ys.push_back(at::empty({B, C}, x.options()));
  }
  at::parallel_for(0, J, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const std::optional<at::Tensor> bias = biases.get(j);
      lora_chain(xs[j], firsts[j], seconds[j], bias ? bias->data_ptr<float>() : nullptr, inner[j], outer[j],
                 ys[j].data_ptr<float>());
    }
  });
  return ys;
}

// One head's state update and read-out, row = value index: sa = S[row] . (-kk), S[row] = S[row] * w + sa * bb +
// v[row] * kn, o[row] = S[row] . r. update_rows takes four rows at a time in vectors of the CPU's width (N a multiple
// of 16): their dot products run side by side and each is reduced once, in a fixed order (so a row's bits depend on
// nothing but its inputs); update_row is the plain loop for other head sizes.
void update_rows(float* Sh, const float* kk, const float* w, const float* bb, const float* kn, const float* r,
                 const float* v, float* o, int64_t N) {
  for (int64_t row = 0; row < N; row += 4) {
    float* const s = Sh + row * N;  // rows i = 0..3 at s + i * N
    vrow a[4] = {};
    for (int64_t j = 0; j < N; j += kRowWidth) {
      const vrow kv = load_row(kk + j);
      for (int i = 0; i < 4; ++i) a[i] += load_row(s + i * N + j) * kv;
    }
    float sa[4], vr[4];
    for (int i = 0; i < 4; ++i) sa[i] = -hsum_row(a[i]), vr[i] = v[row + i];
    vrow acc[4] = {};
    for (int64_t j = 0; j < N; j += kRowWidth) {
      const vrow wv = load_row(w + j), bv = load_row(bb + j), knv = load_row(kn + j), rv = load_row(r + j);
      for (int i = 0; i < 4; ++i) {
        const vrow sv = load_row(s + i * N + j) * wv + sa[i] * bv + vr[i] * knv;
        std::memcpy(s + i * N + j, &sv, sizeof sv);
        acc[i] += sv * rv;
      }
    }
    for (int i = 0; i < 4; ++i) o[row + i] = hsum_row(acc[i]);
  }
}

constexpr int64_t AHEAD_TOKENS = 4;  // how far ahead a prefill's input rows are fetched

inline void prefetch_head(const float* p, int64_t N) {
  for (int64_t j = 0; j < N; j += 16) __builtin_prefetch(p + j);
}

// dst = src^T for one N x N head
void transpose(const float* src, float* dst, int64_t N) {
  for (int64_t r = 0; r < N; ++r)
    for (int64_t c = 0; c < N; ++c) dst[c * N + r] = src[r * N + c];
}

// update_rows on the head's transpose ST[j][row] (N = 16 R): one vector of rows at a time, every sum vertical
// (broadcast kk[j], w[j], ... down the rows), each over j in order in two interleaved halves (even and odd j) so that
// consecutive fused multiply-adds do not wait on each other. Rows are independent, so they run in groups of
// `kColumnGroup` vectors whose sums fit the registers (a whole 64-row head in AVX-512's 32; with AVX2's 16 a 64-row
// group spilled, and a 1,024-token prefill's wkv took 7x as long); neither the group nor the width moves a sum.
constexpr int64_t kColumnGroup = 4;

template <int R>
void update_columns(float* ST, const float* kk, const float* w, const float* bb, const float* kn, const float* r,
                    const float* v, float* o) {
  constexpr int64_t N = 16 * R, W = kRowWidth, G = N / W < kColumnGroup ? N / W : kColumnGroup;
  static_assert((N / W) % G == 0);
  for (int64_t c0 = 0; c0 < N; c0 += G * W) {
    vrow sa[2][G] = {}, acc[2][G] = {};
    for (int64_t j = 0; j < N; ++j)
      for (int64_t c = 0; c < G; ++c) sa[j & 1][c] += load_row(ST + j * N + c0 + W * c) * kk[j];
    vrow vr[G];
    for (int64_t c = 0; c < G; ++c) sa[0][c] = -(sa[0][c] + sa[1][c]), vr[c] = load_row(v + c0 + W * c);
    for (int64_t j = 0; j < N; ++j) {
      const float wj = w[j], bj = bb[j], kj = kn[j], rj = r[j];
      for (int64_t c = 0; c < G; ++c) {
        float* p = ST + j * N + c0 + W * c;
        const vrow sv = load_row(p) * wj + sa[0][c] * bj + vr[c] * kj;
        std::memcpy(p, &sv, sizeof sv);
        acc[j & 1][c] += sv * rj;
      }
    }
    for (int64_t c = 0; c < G; ++c) {
      const vrow out = acc[0][c] + acc[1][c];
      std::memcpy(o + c0 + W * c, &out, sizeof out);
    }
  }
}

void update_row(float* s, const float* kk, const float* w, const float* bb, const float* kn, const float* r,
                float vr, float* o, int64_t N) {
  float sa = 0.f;
#pragma omp simd reduction(+ : sa)
  for (int64_t j = 0; j < N; ++j) sa -= s[j] * kk[j];
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < N; ++j) {
    s[j] = s[j] * w[j] + sa * bb[j] + vr * kn[j];
    acc += s[j] * r[j];
  }
  *o = acc;
}

std::tuple<at::Tensor, at::Tensor> wkv(const at::Tensor& S, const at::Tensor& r, const at::Tensor& decay,
                                       const at::Tensor& k, const at::Tensor& v, const at::Tensor& v_first,
                                       const std::optional<at::Tensor>& v_mix, const at::Tensor& a,
                                       const at::Tensor& g, const at::Tensor& k_k, const at::Tensor& k_a,
                                       const at::Tensor& r_k, const at::Tensor& ln_w, const at::Tensor& ln_b,
                                       double gn_eps, int64_t tokens, bool steps) {
  TORCH_CHECK(S.scalar_type() == at::kFloat && S.device().is_cpu() && S.dim() == 4 && S.size(2) == S.size(3),
              "S must be a CPU float32 [B, H, N, N]");
  TORCH_CHECK(tokens >= 1, "tokens must be at least 1");
  const int64_t B = S.size(0), H = S.size(1), N = S.size(2), C = H * N, T = tokens;
  TORCH_CHECK(S.stride(3) == 1 && S.stride(2) == N && S.stride(1) == N * N, "S must have contiguous heads");
  const at::Tensor* rows[] = {&r, &decay, &k, &v, &v_first, &a, &g};
  const char* names[] = {"r", "decay", "k", "v", "v_first", "a", "g"};
  for (int i = 0; i < 7; ++i) check_rows(*rows[i], B * T, C, names[i]);
  if (v_mix) check_rows(*v_mix, B * T, C, "v_mix");
  check_vector(k_k, C, "k_k");
  check_vector(k_a, C, "k_a");
  check_vector(r_k, C, "r_k");
  check_vector(ln_w, C, "ln_w");
  check_vector(ln_b, C, "ln_b");
  at::Tensor out = at::empty({B * T, C}, r.options()), v_out = at::empty({B * T, C}, r.options());
  float *pS = S.data_ptr<float>(), *po = out.data_ptr<float>(), *pvo = v_out.data_ptr<float>();
  const float* pmix = v_mix ? v_mix->data_ptr<float>() : nullptr;
  const int64_t smix = v_mix ? v_mix->stride(0) : 0, sS = S.stride(0);
  const float feps = static_cast<float>(gn_eps);
  // a head's work is ~4 N^2 flops a token (16K at N = 64): only many head-tokens pay for waking a second thread.
  // Work items are (row of S, head), each running its tokens in order: token t of a row is input row b * T + t, the
  // arithmetic of T calls of one token each, except that several tokens on a head of 32, 64 or 128 values run on its
  // transpose (update_columns: no horizontal sums, the state's sums in another order), copied in before the first
  // token and back after the last; with `steps`, not: the bits of T calls of one token (a layer's few tokens).
  const bool transposed = T > 1 && !steps && (N == 32 || N == 64 || N == 128);
  at::parallel_for(0, B * H, std::max<int64_t>(1, 64 / T), [&](int64_t i0, int64_t i1) {
    std::vector<float> kk(N), kn(N), bb(N), w(N), o(N), ST(transposed ? N * N : 0);
    for (int64_t i = i0; i < i1; ++i) {
      float* Sh = pS + (i / H) * sS + (i % H) * N * N;
      if (i + 1 < i1) {  // the next head's state into L2 while this one computes (a decode step's states come from
        // memory: the op ran 1.1-1.26x faster with it at 1-64 rows, AMD EPYC avx512, two heads ahead slower; whole
        // engine steps 0.98-1.04x, the op being ~10% of one)
        const char* next = reinterpret_cast<const char*>(pS + ((i + 1) / H) * sS + ((i + 1) % H) * N * N);
        for (int64_t o = 0; o < N * N * static_cast<int64_t>(sizeof(float)); o += 64) __builtin_prefetch(next + o, 1, 2);
      }
      if (transposed) transpose(Sh, ST.data(), N);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t b = i / H, h = i % H, off = h * N, row_bt = b * T + t;
        auto at_row = [&](const at::Tensor& x) { return x.data_ptr<float>() + row_bt * x.stride(0) + off; };
        if (t + AHEAD_TOKENS < T) {  // a prefill's rows are a whole model width apart: fetch this head's ahead
          for (const at::Tensor* x : {&r, &decay, &k, &v, &v_first, &a, &g})
            prefetch_head(at_row(*x) + AHEAD_TOKENS * x->stride(0), N);
          if (v_mix) prefetch_head(at_row(*v_mix) + AHEAD_TOKENS * v_mix->stride(0), N);
          prefetch_head(po + (row_bt + AHEAD_TOKENS) * C + off, N);
          prefetch_head(pvo + (row_bt + AHEAD_TOKENS) * C + off, N);
        }
        const float *pr = at_row(r), *pd = at_row(decay), *pk = at_row(k), *pv = at_row(v), *pvf = at_row(v_first);
        const float *pa = at_row(a), *pg = at_row(g);
        const float *kkw = k_k.data_ptr<float>() + off, *kaw = k_a.data_ptr<float>() + off;
        const float *rkw = r_k.data_ptr<float>() + off, *lw = ln_w.data_ptr<float>() + off;
        const float* lb = ln_b.data_ptr<float>() + off;
        float* vo = pvo + row_bt * C + off;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < N; ++j) {
          kk[j] = pk[j] * kkw[j];
          ss += kk[j] * kk[j];
        }
        const float norm = std::sqrt(ss);
        const float inv = 1.0f / (norm > 1e-12f ? norm : 1e-12f);  // F.normalize's eps
        float bonus = 0.f;
#pragma omp simd reduction(+ : bonus)
        for (int64_t j = 0; j < N; ++j) {
          kk[j] *= inv;
          kn[j] = pk[j] * (1.0f + (pa[j] - 1.0f) * kaw[j]);
          bb[j] = kk[j] * pa[j];
          w[j] = exp_approx(-kDecayScale * pd[j]);
          bonus += pr[j] * kn[j] * rkw[j];
        }
        if (pmix) {
          const float* pm = pmix + row_bt * smix + off;
#pragma omp simd
          for (int64_t j = 0; j < N; ++j) vo[j] = pv[j] + (pvf[j] - pv[j]) * pm[j];
        } else {
#pragma omp simd
          for (int64_t j = 0; j < N; ++j) vo[j] = pv[j];
        }
        if (transposed) {
          void (*update)(float*, const float*, const float*, const float*, const float*, const float*, const float*,
                         float*) = N == 32 ? update_columns<2> : N == 64 ? update_columns<4> : update_columns<8>;
          update(ST.data(), kk.data(), w.data(), bb.data(), kn.data(), pr, vo, o.data());
        } else if (N % 16 == 0) {
          update_rows(Sh, kk.data(), w.data(), bb.data(), kn.data(), pr, vo, o.data(), N);
        } else {
          for (int64_t row = 0; row < N; ++row)
            update_row(Sh + row * N, kk.data(), w.data(), bb.data(), kn.data(), pr, vo[row], o.data() + row, N);
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < N; ++j) sum += o[j];
        const float mean = sum / static_cast<float>(N);
        float var = 0.f;
#pragma omp simd reduction(+ : var)
        for (int64_t j = 0; j < N; ++j) var += (o[j] - mean) * (o[j] - mean);
        const float inv_sd = 1.0f / std::sqrt(var / static_cast<float>(N) + feps);
        float* out_h = po + row_bt * C + off;
#pragma omp simd
        for (int64_t j = 0; j < N; ++j) out_h[j] = ((o[j] - mean) * inv_sd * lw[j] + lb[j] + bonus * vo[j]) * pg[j];
      }
      if (transposed) transpose(ST.data(), Sh, N);
    }
  });
  return {out, v_out};
}

at::Tensor relu_square(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "x must be [B, C]");
  check_rows(x, x.size(0), x.size(1), "x");
  const int64_t B = x.size(0), C = x.size(1), sx = x.stride(0);
  at::Tensor y = at::empty({B, C}, x.options());
  const float* px = x.data_ptr<float>();
  float* py = y.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) {
      const float t = px[b * sx + c] > 0.f ? px[b * sx + c] : 0.f;
      py[b * C + c] = t * t;
    }
  }
  return y;
}

// The tensors of a layer `layer` takes, in this order (`w`; the v LoRA's three are None in layer 0, which has none).
enum LayerTensor {
  LN1_W, LN1_B, ATT_MIX, W_R, W_K, W_V, W1, W2, W0, A1, A2, A0, G1, G2, V1, V2, V0, K_K, K_A, R_K, LNX_W, LNX_B, W_O,
  LN2_W, LN2_B, FFN_X_K, W_KEY, W_VALUE, LAYER_TENSORS
};

// One decode step (one token a row: x [B, C]) of a whole layer, as model.py's `_decode_layer` runs it: the same ops
// in the same order on the same kernels (matmuls through linear_call.h: `kernel`, `args` two a matrix in the order r,
// k, v, output, ffn key, ffn value), so the same bits, without the ~90 us of Python and views a layer measured on the
// 0.1B shape (int8, one row, AMD EPYC). The states (att_shift, S, ffn_shift) advance in place. Returns (x, v_first:
// layer 0's v, or the one given). With `tokens` T > 1, x and v_first are [B * T, C] (row b's tokens in order): the
// token shifts and the wkv run token by token, the matmuls and LoRAs over the B * T rows at once (each row's bits the
// same whatever rows come with it: the caller checks the matrices' kernel, `rows_independent`), so the bits of T
// one-token calls at about one call's cost (a moved stream's catch-up, a chat turn's few new tokens).
std::tuple<at::Tensor, at::Tensor> layer(const at::Tensor& x, const at::Tensor& v_first, const at::Tensor& att_shift,
                                         const at::Tensor& S, const at::Tensor& ffn_shift,
                                         const c10::List<std::optional<at::Tensor>>& w, const std::string& kernel,
                                         at::IntArrayRef args, double ln_eps, double gn_eps, int64_t tokens) {
  TORCH_CHECK(static_cast<int64_t>(w.size()) == LAYER_TENSORS, "w: ", static_cast<int64_t>(LAYER_TENSORS),
              " tensors (model.py's order)");
  TORCH_CHECK(args.size() == 12, "args: two a matrix");
  auto t = [&](int i) {
    const std::optional<at::Tensor> v = w.get(i);
    TORCH_CHECK(v.has_value(), "w[", i, "] is missing");
    return *v;
  };
  const bool first = !w.get(V1).has_value();
  const wkvm::LinearCall& linear = wkvm::linear_call(kernel);
  const int64_t C = x.size(-1);
  const at::Tensor mixed = std::get<1>(norm_shift_mix(x, std::nullopt, t(LN1_W), t(LN1_B), ln_eps, att_shift,
                                                      t(ATT_MIX).reshape({-1, C}), tokens));
  const at::Tensor xr = mixed[0], xw = mixed[1], xk = mixed[2], xv = mixed[3], xa = mixed[4], xg = mixed[5];
  const at::Tensor r = linear(xr, t(W_R), args[0], args[1]);
  const at::Tensor k = linear(xk, t(W_K), args[2], args[3]);
  const at::Tensor v = linear(xv, t(W_V), args[4], args[5]);
  std::vector<at::Tensor> xs{xw, xa, xg}, firsts{t(W1), t(A1), t(G1)}, seconds{t(W2), t(A2), t(G2)};
  c10::List<std::optional<at::Tensor>> biases({t(W0), t(A0), std::nullopt});
  std::vector<int64_t> inner{1, 0, 2}, outer{2, 2, 0};  // tanh, none, sigmoid; sigmoid, sigmoid, none (step.py)
  if (!first) {
    xs.push_back(xv), firsts.push_back(t(V1)), seconds.push_back(t(V2)), biases.push_back(t(V0));
    inner.push_back(0), outer.push_back(2);
  }
  const std::vector<at::Tensor> l = loras(xs, firsts, seconds, biases, inner, outer);
  const at::Tensor vf = first ? v : v_first;
  const at::Tensor o = std::get<0>(wkv(S, r, l[0], k, v, vf, first ? std::nullopt : std::optional<at::Tensor>(l[3]), l[1], l[2],
                                       t(K_K), t(K_A), t(R_K), t(LNX_W), t(LNX_B), gn_eps, tokens, true));
  auto [x2, ffn] = norm_shift_mix(x, linear(o, t(W_O), args[6], args[7]), t(LN2_W), t(LN2_B), ln_eps, ffn_shift,
                                  t(FFN_X_K).reshape({-1, C}), tokens);
  const at::Tensor y = linear(relu_square(linear(ffn[0], t(W_KEY), args[8], args[9])), t(W_VALUE), args[10], args[11]);
  return {at::add(x2, y), vf};
}

}  // namespace

TORCH_LIBRARY(wkvm_rwkv7, m) {
  m.def(
      "norm_shift_mix(Tensor x, Tensor? add, Tensor ln_w, Tensor ln_b, float eps, Tensor(a!) shift, Tensor mix, "
      "int tokens=1) -> (Tensor, Tensor)",
      &norm_shift_mix);
  m.def(
      "loras(Tensor[] xs, Tensor[] firsts, Tensor[] seconds, Tensor?[] biases, int[] inner, int[] outer) "
      "-> Tensor[]",
      &loras);
  m.def(
      "wkv(Tensor(a!) S, Tensor r, Tensor decay, Tensor k, Tensor v, Tensor v_first, Tensor? v_mix, Tensor a, "
      "Tensor g, Tensor k_k, Tensor k_a, Tensor r_k, Tensor ln_w, Tensor ln_b, float gn_eps, int tokens=1, "
      "bool steps=False) -> (Tensor, Tensor)",
      &wkv);
  m.def("relu_square(Tensor x) -> Tensor", &relu_square);
  m.def(
      "layer(Tensor x, Tensor v_first, Tensor(a!) att_shift, Tensor(b!) S, Tensor(c!) ffn_shift, Tensor?[] w, "
      "str kernel, int[] args, float ln_eps, float gn_eps, int tokens=1) -> (Tensor, Tensor)",
      &layer);
}
