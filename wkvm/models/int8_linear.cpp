// y[M, N] = x[M, K] @ dequant(W)^T for weight-only int8 matrices; wkvm/models/int8.py describes the format:
// W is int8 [N, K + 4]; with K even, each whole group of 32 rows is a block of K/2 "pair rows" of 64 bytes (row r's
// weights k and k + 1 at bytes 2r, 2r + 1) followed by the 32 rows' fp32 scales; the rows after the last whole
// block (and all rows when K is odd) are plain: K weights, then the row's scale.
//
// Decode sizes. Each row of x is first rounded to int8 per group of 32 values (x_groups.h: scale max|x| / 127, as
// llama.cpp's q8 activation blocks), so a group's products are exact integer sums and
//   y[m, n] = s_n * (sum over groups g, in order, of isum_g * dx_g)   (one fused multiply-add per group),
// the same float operations in the same order on every path (std::fma in C++; the build turns off the compiler's
// own contraction), so the portable, AVX2, AVX-512 and VNNI paths return the same bits. With AVX512-VNNI two pair
// rows are interleaved into quads (row r's k..k+3 in one 32-bit lane) and multiplied by vpdpbusd, 64 products per
// instruction: the weights are made unsigned by flipping their top bit (w + 128) and 128 * sum(xq) is subtracted
// from the group's integer sum. Without VNNI (AVX-512BW, AVX2) the pairs are widened to int16 and multiplied by
// vpmaddwd (32 products per AVX-512 instruction). A register holds one lane per output row, so x's values are
// broadcast and no horizontal sums are needed, and the matrix is read as one sequential stream. Output blocks are
// split across torch's own thread pool (at::parallel_for). One build serves every x86 CPU: the vector kernels carry
// target attributes and the caller picks one (isa: 0 portable C++, 1 AVX2, 2 AVX-512BW, 3 AVX512-VNNI, 4 AMX-INT8:
// tdpbssd on tiles from 32 rows of x, the VNNI path below; int8_blocks.h); best_isa() says what this CPU runs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "x_groups.h"
#include "int8_blocks.h"

namespace {

using namespace wkvm::int8;

void check_weights(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.device().is_cpu(),
              "w: contiguous int8 [N, K + 4] on the CPU");
}

// x [..., K] -> [..., N] (the leading dimensions are flattened here: a view costs ~1.5 us in Python, per call)
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t isa) {
  check_weights(w);
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == at::kFloat && x_in.is_contiguous() && x_in.device().is_cpu(),
              "x: contiguous float32 [..., K] on the CPU");
  const at::Tensor x = x_in.view({-1, x_in.size(-1)});
  TORCH_CHECK(w.size(1) == x.size(1) + 4, "w rows must hold K = x.size(1) weights and a float32 scale");
  TORCH_CHECK(isa >= 0 && isa <= best_isa(), "this CPU cannot run kernel isa ", isa);
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1), G = (K + X_GROUP - 1) / X_GROUP;
  std::unique_ptr<int8_t[]> xq(new int8_t[M * K]);  // uninitialized: every element is written
  std::unique_ptr<float[]> xs(new float[M * G]);
  std::unique_ptr<int32_t[]> xsum(new int32_t[M * G]);
  wkvm::quantize_groups(x.data_ptr<float>(), M, K, xq.get(), xs.get(), xsum.get(), isa);
  std::unique_ptr<int16_t[]> x16;
  if (isa == 1 || isa == 2) {  // the vpmaddwd paths multiply int16 pairs
    x16.reset(new int16_t[M * K]);
    for (int64_t i = 0; i < M * K; ++i) x16[i] = xq[i];
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const Problem p{xq.get(), x16.get(), xs.get(), xsum.get(), w.data_ptr<int8_t>(), y.data_ptr<float>(),
                  M, N, K, G, K % 2 ? 0 : N / BLOCK};
  const Blocks blocks = blocks_of(isa);
  // each thread a contiguous band, at least ~64 KiB of weights, so that its share is worth waking it for
  const int64_t grain_rows = std::max<int64_t>(1, (int64_t(1) << 16) / (K + 4));
  at::parallel_for(0, p.blocks, (grain_rows + BLOCK - 1) / BLOCK, [&](int64_t b0, int64_t b1) { blocks(p, b0, b1); });
  at::parallel_for(p.blocks * BLOCK, N, grain_rows, [&](int64_t n0, int64_t n1) { rows_scalar(p, n0, n1); });
  std::vector<int64_t> sizes = x_in.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// row n of W as fp32 (each weight times the row's scale: int8.dequantize's one multiply, so the same bits) at dst
void dequantize_row(const Problem& p, int64_t n, float* dst) {
  const int64_t K = p.K;
  const float s = scale_of(p, n);
  if (n < p.blocks * BLOCK) {
    const int8_t* src = block_at(p, n / BLOCK) + 2 * (n % BLOCK);
    for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(src[(k & ~int64_t(1)) * BLOCK + (k & 1)]) * s;
  } else {
    const int8_t* src = p.w + n * (K + 4);
    for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(src[k]) * s;
  }
}

Problem rows_of(const at::Tensor& w, float* out) {
  const int64_t N = w.size(0), K = w.size(1) - 4;
  return Problem{nullptr, nullptr, nullptr, nullptr, w.data_ptr<int8_t>(), out, 0, N, K, 0, K % 2 ? 0 : N / BLOCK};
}

// W -> fp32 [N, K] in one parallel pass (prefill multiplies that with oneDNN's fp32 GEMM).
at::Tensor dequantize(const at::Tensor& w) {
  check_weights(w);
  const int64_t N = w.size(0), K = w.size(1) - 4;
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  const Problem p = rows_of(w, out.data_ptr<float>());
  at::parallel_for(0, N, std::max<int64_t>(BLOCK, (int64_t(1) << 16) / (K + 4)), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) dequantize_row(p, n, p.y + n * K);
  });
  return out;
}

// rows `ids` (int64, any shape) of W as fp32 [..., K]: an embedding lookup (a decode step's 1-8 SmolLM2 rows took
// 50-66 us in int8.embedding's torch ops, 4-8 us through this op; a prompt's rows are split over torch's threads)
at::Tensor embedding(const at::Tensor& ids, const at::Tensor& w) {
  check_weights(w);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.device().is_cpu(),
              "ids: contiguous int64 on the CPU");
  const int64_t N = w.size(0), K = w.size(1) - 4, n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "token id ", id[i], " is not in 0..", N - 1);
  std::vector<int64_t> sizes = ids.sizes().vec();
  sizes.push_back(K);
  at::Tensor out = at::empty(sizes, w.options().dtype(at::kFloat));
  const Problem p = rows_of(w, out.data_ptr<float>());
  at::parallel_for(0, n, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dequantize_row(p, id[i], p.y + i * K);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(wkvm_int8, m) {
  m.def("linear(Tensor x, Tensor w, int isa) -> Tensor", &linear);
  m.def("dequantize(Tensor w) -> Tensor", &dequantize);
  m.def("embedding(Tensor ids, Tensor w) -> Tensor", &embedding);
  m.def("best_isa() -> int", &best_isa);
}
