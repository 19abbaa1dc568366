// y[M, N] = x[M, K] @ W^T for decode-sized M, reading W where oneDNN's prepacked copy keeps it (no second copy).
//
// oneDNN packs an fp32 [N, K] weight (torch.ops.mkldnn._reorder_linear_weight) in panels: ceil(N / P) panels of
// Kp x P floats, panel b's row k holding W[b P .. b P + P - 1, k] (P = 64 and Kp = K rounded up to 16 on the
// AVX-512 machine measured). `probe` checks that layout on a matrix of distinct values; fp32gemv.py uses the kernel
// only for shapes whose probe passed. A panel is then one sequential stream: x[m, k] is broadcast and multiplied
// into P / W accumulator registers per row of x (W floats a register), so there are no horizontal sums.
//
// Every y[m, n] is one accumulator updated by one fused multiply-add per k, k = 0, 1, ..., K - 1, whatever M and
// however the rows of x are tiled: a row computed alone or in a batch gives the same bits. Panels are split across
// torch's threads (at::parallel_for) in contiguous bands, each band one stream of weights.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
using vec = __m512;
constexpr int W = 16, REGS = 24;  // accumulators a tile may hold (of 32 registers)
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vset1(float v) { return _mm512_set1_ps(v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int W = 8, REGS = 12;  // of 16 registers
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vset1(float v) { return _mm256_set1_ps(v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
#else  // no AVX2: compiles, but `supports` refuses every panel and oneDNN multiplies
using vec = float;
constexpr int W = 1, REGS = 12;
inline vec vzero() { return 0.f; }
inline vec vload(const float* p) { return *p; }
inline vec vset1(float v) { return v; }
inline vec vfma(vec a, vec b, vec c) { return std::fma(a, b, c); }
inline void vstore(float* p, vec v) { *p = v; }
#endif

constexpr int MAX_MT = 6;  // rows of x per pass over a panel

struct Problem {
  const float* x;  // [M, K], rows ldx apart
  const float* w;  // panels [ceil(N / P)][Kp][P]
  float* y;        // [M, N]
  int64_t M, N, K, Kp, ldx;
};

// rows m..m+MT of x against panel b (P = NV * W outputs)
template <int NV, int MT>
void tile(const Problem& p, int64_t b, int64_t m) {
  constexpr int P = NV * W;
  const float* w = p.w + b * p.Kp * P;
  const float* x = p.x + m * p.ldx;
  vec acc[MT][NV];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = vzero();
  for (int64_t k = 0; k < p.K; ++k) {
    const float* row = w + k * P;
    for (int i = 0; i < MT; ++i) {
      const vec xv = vset1(x[i * p.ldx + k]);
      for (int j = 0; j < NV; ++j) acc[i][j] = vfma(xv, vload(row + j * W), acc[i][j]);
    }
  }
  const int64_t n0 = b * P, valid = std::min<int64_t>(P, p.N - n0);
  for (int i = 0; i < MT; ++i) {
    float* y = p.y + (m + i) * p.N + n0;
    if (valid == P) {
      for (int j = 0; j < NV; ++j) vstore(y + j * W, acc[i][j]);
    } else {
      alignas(64) float lanes[P];
      for (int j = 0; j < NV; ++j) vstore(lanes + j * W, acc[i][j]);
      std::memcpy(y, lanes, valid * sizeof(float));
    }
  }
}

constexpr int max_mt(int nv) { return std::max(1, std::min(MAX_MT, REGS / nv)); }

// the last M - m < MT rows in one pass
template <int NV, int R>
void rest(const Problem& p, int64_t b, int64_t m) {
  if constexpr (R > 0) {
    if (p.M - m == R) return tile<NV, R>(p, b, m);
    rest<NV, R - 1>(p, b, m);
  }
}

template <int NV>
void panels(const Problem& p, int64_t b0, int64_t b1) {
  constexpr int MT = max_mt(NV);
  for (int64_t b = b0; b < b1; ++b) {
    int64_t m = 0;
    for (; m + MT <= p.M; m += MT) tile<NV, MT>(p, b, m);
    rest<NV, MT - 1>(p, b, m);
  }
}

using PanelsFn = void (*)(const Problem&, int64_t, int64_t);

PanelsFn panels_for(int64_t P) {
  if (W == 1 || P % W) return nullptr;
  switch (P / W) {
    case 1: return panels<1>;
    case 2: return panels<2>;
    case 3: return panels<3>;
    case 4: return panels<4>;
    case 6: return panels<6>;
    case 8: return panels<8>;
    default: return nullptr;
  }
}

const float* packed_data(const at::Tensor& w) {
  TORCH_CHECK(w.is_mkldnn() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "w: a float32 weight prepacked by oneDNN (linear.pack_linear)");
  static const auto data_ptr = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("mkldnn::data_ptr", "")
                                   .typed<int64_t(const at::Tensor&)>();
  return reinterpret_cast<const float*>(data_ptr.call(w));
}

// Rows of x up to which this build beat oneDNN's packed GEMM, weights read from memory (AMD EPYC, 2 threads,
// layer shapes and the head of the RWKV-7 0.1B shape): AVX-512 1.08-1.18x at 32 rows; AVX2 0.88-1.06x at 12, 0.82-0.92x
// at 16 (one pass per row of x: its 12 registers hold one row's sums of a 64-wide panel). fp32gemv.rows asks.
int64_t max_rows() { return W == 16 ? 32 : W == 8 ? 12 : 0; }

// Whether this build multiplies panels of P floats; the fp32gemv.py side asks before trusting a layout.
bool supports(int64_t P) { return panels_for(P) != nullptr; }

// The panel width P and padded depth Kp of `packed`, oneDNN's copy of the probe matrix bits(probe[n, k]) = BASE +
// n K + k; [0, 0] unless every one of its N K values sits where the panel layout says (padding is never read).
std::vector<int64_t> probe(const at::Tensor& packed, int64_t base, int64_t bytes) {
  const int64_t N = packed.size(0), K = packed.size(1);
  const int32_t* v = reinterpret_cast<const int32_t*>(packed_data(packed));
  const int64_t total = bytes / 4;
  auto at = [&](int64_t n, int64_t k) { return base + n * K + k; };
  if (N < 2 || K < 2 || total < N * K || v[0] != at(0, 0) || v[1] != at(1, 0)) return {0, 0};
  int64_t P = 2;  // (0, 1) starts the panel's second row
  while (P < total && v[P] != at(0, 1)) ++P;
  const int64_t panels = (N + P - 1) / P;
  if (P >= total || total % (panels * P)) return {0, 0};
  const int64_t Kp = total / (panels * P);
  if (Kp < K) return {0, 0};
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      if (v[(n / P) * Kp * P + k * P + n % P] != at(n, k)) return {0, 0};
  return {P, Kp};
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t P, int64_t Kp) {
  const float* wp = packed_data(w);
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1 &&
                  x.size(1) == K,
              "x: float32 [M, K] on the CPU with unit column stride");
  const PanelsFn run = panels_for(P);
  TORCH_CHECK(run != nullptr && Kp >= K, "panel width ", P, " is not one this build multiplies");
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return y;
  const Problem p{x.data_ptr<float>(), wp, y.data_ptr<float>(), M, N, K, Kp, M > 1 ? x.stride(0) : K};
  // a band of at least ~256 KiB of weights per thread: smaller ones cost more to hand out than they save
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (Kp * P));
  at::parallel_for(0, (N + P - 1) / P, grain, [&](int64_t b0, int64_t b1) { run(p, b0, b1); });
  return y;
}

}  // namespace

TORCH_LIBRARY(wkvm_fp32, m) {
  m.def("linear(Tensor x, Tensor w, int P, int Kp) -> Tensor", &linear);
  m.def("probe(Tensor packed, int base, int nbytes) -> int[]", &probe);
  m.def("supports(int P) -> bool", &supports);
  m.def("max_rows() -> int", &max_rows);
}
