// x rounded to int8 per group of 32 values along K, shared by the int8 and int4 kernels (llama.cpp's q8 activation
// blocks do the same). int8.load_kernel hashes the headers a source includes with quotes, so editing this file
// rebuilds both kernels.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace wkvm {

constexpr int64_t X_GROUP = 32;

// Row m's group g holds x[m, 32g .. min(K, 32g + 32)) (only a row's last group can be shorter); G = ceil(K / 32).
// scale[m * G + g] = max|x| / 127 over the group, q = x / scale rounded to nearest (ties to even) in -127..127,
// sum[m * G + g] = the group's sum of q. Portable C++ (GCC vectorizes it for the baseline ISA): every kernel path
// sees the same integers and scales.
inline void quantize_groups(const float* x, int64_t M, int64_t K, int8_t* q, float* scale, int32_t* sum) {
  constexpr float ROUND = 12582912.f;  // 1.5 * 2^23: adding then subtracting it rounds to nearest, ties to even
  const int64_t G = (K + X_GROUP - 1) / X_GROUP;
  at::parallel_for(0, M * G, 512, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / G, k0 = (i % G) * X_GROUP, n = std::min(X_GROUP, K - k0);
      const float* r = x + m * K + k0;
      float amax = 0.f;
      for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(r[k]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      scale[i] = amax / 127.f;
      int32_t s = 0;
      for (int64_t k = 0; k < n; ++k) {
        float v = r[k] * inv;
        v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
        const int32_t qi = static_cast<int32_t>((v + ROUND) - ROUND);
        q[m * K + k0 + k] = static_cast<int8_t>(qi);
        s += qi;
      }
      sum[i] = s;
    }
  });
}

}  // namespace wkvm
