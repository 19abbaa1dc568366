// A decode-sized matmul on one of wkvm's own kernels (the `linear` op of wkvm_int8, wkvm_int4 or wkvm_fp32), called
// from a fused layer's op through the dispatcher rather than through linear.py's Python wrappers: the op, and the
// arguments, that models/linear.py's `linear` calls for the same weights, so a fused layer gives the same bits.
// int8.load_kernel hashes the headers a source includes with quotes: editing this file rebuilds its users.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <optional>
#include <string>

namespace wkvm {

// `ns`: wkvm_int8 or wkvm_int4 (`a` the kernel's isa), or wkvm_fp32 (`a`, `b` the packed layout's panel width and
// padded depth). x [M, K] float32 with unit column stride.
class LinearCall {
 public:
  explicit LinearCall(const std::string& ns) : fp32_(ns == "wkvm_fp32") {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow((ns + "::linear").c_str(), "");
    if (fp32_) {
      fp32_op_.emplace(op.typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)>());
    } else {
      quant_op_.emplace(op.typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>());
    }
  }

  at::Tensor operator()(const at::Tensor& x, const at::Tensor& w, int64_t a, int64_t b) const {
    return fp32_ ? fp32_op_->call(x, w, a, b) : quant_op_->call(x, w, a);
  }

 private:
  bool fp32_;
  std::optional<c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)>> fp32_op_;
  std::optional<c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>> quant_op_;
};

// One LinearCall per kernel, found on first use (the kernel's library must be loaded by then: linear.py does).
inline const LinearCall& linear_call(const std::string& ns) {
  TORCH_CHECK(ns == "wkvm_int8" || ns == "wkvm_int4" || ns == "wkvm_fp32",
              "linear kernel must be wkvm_int8, wkvm_int4 or wkvm_fp32, not ", ns);
  if (ns == "wkvm_int8") {
    static const LinearCall int8(ns);
    return int8;
  }
  if (ns == "wkvm_int4") {
    static const LinearCall int4(ns);
    return int4;
  }
  static const LinearCall fp32(ns);
  return fp32;
}

}  // namespace wkvm
