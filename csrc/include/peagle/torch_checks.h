// Input checks shared by the CPU implementations and the CUDA glue: every failure names the
// argument, the expected and the actual shape/dtype/device (TORCH_CHECK -> RuntimeError).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <string>

namespace peagle {

inline std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

inline void check_dtype(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, "peagle: ", name, " must have dtype ", dtype, ", got ",
              t.scalar_type());
}

inline void check_dim(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, "peagle: ", name, " must be ", dim, "-D, got shape ", shape_str(t));
}

// Exact sizes; -1 means "any".
inline void check_shape(const at::Tensor& t, const char* name, std::initializer_list<int64_t> sizes) {
  bool ok = t.dim() == static_cast<int64_t>(sizes.size());
  int64_t i = 0;
  for (int64_t s : sizes) {
    if (!ok) break;
    ok = s < 0 || t.size(i) == s;
    ++i;
  }
  TORCH_CHECK(ok, "peagle: ", name, " must have shape ", c10::IntArrayRef(sizes), " (-1 = any), got ",
              shape_str(t));
}

inline void check_device(const at::Tensor& t, const char* name, const at::Tensor& ref,
                         const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), "peagle: ", name, " is on ", t.device(), " but ", ref_name,
              " is on ", ref.device());
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "peagle: output ", name,
              " must be contiguous (it is written in place), got strides ", c10::str(t.strides()));
}

inline void check_rows_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, "peagle: ", name,
              " must have unit stride in its last dimension, got strides ", c10::str(t.strides()));
}

inline bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

}  // namespace peagle
