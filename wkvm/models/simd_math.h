// Vectorizable float math shared by wkvm's C++ kernels (fused.cpp, rwkv7/step.cpp). int8.load_kernel hashes the
// headers a source includes with quotes, so editing this file rebuilds every kernel that uses it.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace wkvm {

// e^x (x clamped to [-87, 88]): Cody-Waite reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial (relative
// error < 2e-7), times 2^n built in the exponent bits; written so the compiler vectorizes it (std::exp is not;
// the clamps need -fno-trapping-math to be if-converted).
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

}  // namespace wkvm
