// y[M, N] = x[M, K] @ dequant(W)^T for group-wise int4 matrices; wkvm/models/int4.py describes the format:
// W is uint8 [N, G * 20] with G = K / 32 groups per row, weight = q * d + m (q in 0..15, d and m fp16 per group).
// Each whole group of 16 rows is a block; a block's group g is 320 bytes: 4 chunks of 64 bytes, byte 4r + j of
// chunk c holding row r's q[8c + j] (low nibble) and q[8c + 4 + j] (high nibble), then the 16 rows' d, then their m.
// Rows after the last whole block are plain: per group 16 bytes (q[j] low, q[16 + j] high), d, m.
//
// Decode sizes. Each row of x is rounded to int8 per group of 32 (scale max|x| / 127, as llama.cpp's q8 activations)
// and the group's integer sum of x is kept, so that a group's contribution is
//   dx * (d * sum(q * xq) + m * sum(xq)),
// where sum(q * xq) is exact in int32: one vpdpbusd (unsigned nibble x signed int8, 4 products per lane) per
// 4 k with AVX512-VNNI, vpmaddubsw + vpmaddwd on AVX-512BW and AVX2. A register holds one lane per output row
// (16 rows per AVX-512 register, 8 per AVX2 one), so x's 4-byte quads are broadcast and there are no horizontal
// sums. The float arithmetic per group and row is the same two fused multiply-adds in the same order on every path
// (std::fma in C++), and the build turns off the compiler's own contraction, so the portable, AVX2, AVX-512 and VNNI
// paths return the same bits. Output
// blocks are split across torch's own thread pool (at::parallel_for). isa: 0 portable C++, 1 AVX2 (+F16C),
// 2 AVX-512BW, 3 AVX512-VNNI, 4 AMX-INT8 (tdpbsud from 32 rows of x, the VNNI path below; int4_blocks.h);
// best_isa() says what this CPU runs.
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
#include "int4_blocks.h"

namespace {

using namespace wkvm::int4;

int64_t check_weights(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "w: contiguous uint8 [N, G * 20] on the CPU");
  TORCH_CHECK(w.size(1) % ROW_BYTES == 0, "w rows must hold whole groups of 20 bytes");
  return w.size(1) / ROW_BYTES;
}

// x [..., K] -> [..., N] (the leading dimensions are flattened here: a view costs ~1.5 us in Python, per call)
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t isa) {
  const int64_t G = check_weights(w);
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == at::kFloat && x_in.is_contiguous() && x_in.device().is_cpu(),
              "x: contiguous float32 [..., K] on the CPU");
  const at::Tensor x = x_in.view({-1, x_in.size(-1)});
  TORCH_CHECK(x.size(1) == G * GROUP, "x.size(1) must be K = 32 * the groups per row of w");
  TORCH_CHECK(isa >= 0 && isa <= best_isa(), "this CPU cannot run kernel isa ", isa);
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  std::unique_ptr<int8_t[]> xq(new int8_t[M * K]);  // uninitialized: every element is written
  std::unique_ptr<float[]> xs(new float[M * G]);
  std::unique_ptr<float[]> xsd(new float[M * G]);
  std::unique_ptr<int32_t[]> xsum(new int32_t[M * G]);
  wkvm::quantize_groups(x.data_ptr<float>(), M, K, xq.get(), xs.get(), xsum.get(), isa);
  for (int64_t i = 0; i < M * G; ++i) xsd[i] = static_cast<float>(xsum[i]) * xs[i];
  at::Tensor y = at::empty({M, N}, x.options());
  const Problem p{xq.get(), xs.get(), xsd.get(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K, G, N / ROWS};
  const Blocks blocks = blocks_of(isa);
  // each thread a contiguous band of at least ~32 KiB of weights, so that its share is worth waking it for
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / (ROWS * G * ROW_BYTES));
  at::parallel_for(0, p.blocks, grain, [&](int64_t b0, int64_t b1) { blocks(p, b0, b1); });
  rows_scalar(p, p.blocks * ROWS, N);  // at most 15 rows
  std::vector<int64_t> sizes = x_in.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// W -> fp32 [N, K] in one parallel pass, each weight q * d + m as the kernel's terms use them (prefill multiplies
// the result with oneDNN's fp32 GEMM).
at::Tensor dequantize(const at::Tensor& w) {
  const int64_t G = check_weights(w);
  const int64_t N = w.size(0), K = G * GROUP;
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  const Problem p{nullptr, nullptr, nullptr, w.data_ptr<uint8_t>(), out.data_ptr<float>(), 0, N, K, G, N / ROWS};
  at::parallel_for(0, N, ROWS, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t g = 0; g < G; ++g) {
        float* dst = p.y + n * K + g * GROUP;
        const bool blocked = n < p.blocks * ROWS;
        const uint8_t* bg = blocked ? block_group(p, n / ROWS, g) : p.w + n * G * ROW_BYTES + g * ROW_BYTES;
        const int64_t r = n % ROWS;
        const float d = half_to_float(load_u16(blocked ? bg + NIBBLES + 2 * r : bg + 16));
        const float mn = half_to_float(load_u16(blocked ? bg + NIBBLES + 32 + 2 * r : bg + 18));
        for (int64_t k = 0; k < GROUP; ++k)
          dst[k] = static_cast<float>(blocked ? block_q(bg, r, k) : plain_q(bg, k)) * d + mn;
      }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(wkvm_int4, m) {
  m.def("linear(Tensor x, Tensor w, int isa) -> Tensor", &linear);
  m.def("dequantize(Tensor w) -> Tensor", &dequantize);
  m.def("best_isa() -> int", &best_isa);
}
