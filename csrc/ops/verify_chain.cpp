// verify_chain: the op's one torch-facing entry (schema in csrc/registration.cpp). Tensors ->
// VerifyChainParams with every shape/dtype/device check, then the CPU kernel
// (csrc/cpu/verify_chain.cpp, which also checks input values) or the CUDA launcher
// (csrc/cuda/verify_chain_glue.cpp) on the params.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

#include "peagle/backends.h"
#include "peagle/torch_checks.h"

namespace peagle {

struct BoundVerifyChain {
  VerifyChainParams params;
  std::vector<at::Tensor> keep_alive;  // contiguous copies of strided small inputs
};

inline LogitsDtype logits_dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return LogitsDtype::kBFloat16;
    case at::kHalf:
      return LogitsDtype::kFloat16;
    default:
      return LogitsDtype::kFloat32;
  }
}

void verify_chain(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                  const at::Tensor& cu_num_draft_tokens, const at::Tensor& temperature,
                  const at::Tensor& seeds, const at::Tensor& offsets,
                  const at::Tensor& output_token_ids, const at::Tensor& num_accepted,
                  const c10::optional<at::Tensor>& top_k, const c10::optional<at::Tensor>& top_p,
                  const c10::optional<at::Tensor>& draft_probs,
                  const c10::optional<at::Tensor>& uniforms,
                  const c10::optional<at::Tensor>& request_mask,
                  const c10::optional<at::Tensor>& accepted_per_position,
                  const c10::optional<at::Tensor>& bonus_token_ids,
                  const c10::optional<at::Tensor>& exponentials) {
  BoundVerifyChain bound;
  auto& p = bound.params;
  auto in = [&](const at::Tensor& t) -> at::Tensor {
    at::Tensor c = t.contiguous();
    bound.keep_alive.push_back(c);
    return c;
  };

  // Drafts and layout.
  check_dtype(draft_token_ids, "draft_token_ids", at::kInt);
  check_dim(draft_token_ids, "draft_token_ids", 1);
  const int64_t t = draft_token_ids.size(0);
  check_dtype(cu_num_draft_tokens, "cu_num_draft_tokens", at::kInt);
  check_dim(cu_num_draft_tokens, "cu_num_draft_tokens", 1);
  const int64_t b = cu_num_draft_tokens.size(0);
  TORCH_CHECK(b <= INT32_MAX && t < INT32_MAX,
              "peagle: verify_chain supports B, T < 2^31, got B=", b, ", T=", t);

  // Logits [R = T + B, V], unit stride along V, any row stride.
  TORCH_CHECK(is_float_dtype(target_logits.scalar_type()),
              "peagle: target_logits must be float32/float16/bfloat16, got ",
              target_logits.scalar_type());
  check_dim(target_logits, "target_logits", 2);
  const int64_t v = target_logits.size(1);
  TORCH_CHECK(target_logits.size(0) == t + b, "peagle: target_logits must have T + B = ", t, " + ",
              b, " = ", t + b, " rows (each request's draft rows, then its bonus row), got shape ",
              shape_str(target_logits));
  TORCH_CHECK(v >= 1 && v <= INT32_MAX,
              "peagle: target_logits must have 1 <= V < 2^31 columns, got ",
              shape_str(target_logits));
  TORCH_CHECK(target_logits.stride(1) == 1 || v == 1,
              "peagle: target_logits must have unit stride along the vocabulary (any row stride), "
              "got strides ",
              c10::str(target_logits.strides()));

  // Per-request inputs.
  check_dtype(temperature, "temperature", at::kFloat);
  check_shape(temperature, "temperature", {b});
  check_dtype(seeds, "seeds", at::kLong);
  check_shape(seeds, "seeds", {b});
  check_dtype(offsets, "offsets", at::kLong);
  check_shape(offsets, "offsets", {b});
  if (top_k) {
    check_dtype(*top_k, "top_k", at::kInt);
    check_shape(*top_k, "top_k", {b});
  }
  if (top_p) {
    check_dtype(*top_p, "top_p", at::kFloat);
    check_shape(*top_p, "top_p", {b});
  }
  if (request_mask) {
    check_dtype(*request_mask, "request_mask", at::kBool);
    check_shape(*request_mask, "request_mask", {b});
  }
  if (draft_probs) {
    check_dtype(*draft_probs, "draft_probs", at::kFloat);
    check_shape(*draft_probs, "draft_probs", {t, v});
    TORCH_CHECK(draft_probs->stride(1) == 1 || v == 1,
                "peagle: draft_probs must have unit stride along the vocabulary, got strides ",
                c10::str(draft_probs->strides()));
  }
  if (uniforms) {
    check_dtype(*uniforms, "uniforms", at::kDouble);
    check_shape(*uniforms, "uniforms", {t});
  }
  if (bonus_token_ids) {
    check_dtype(*bonus_token_ids, "bonus_token_ids", at::kInt);
    check_shape(*bonus_token_ids, "bonus_token_ids", {b});
  }
  if (exponentials) {
    check_dtype(*exponentials, "exponentials", at::kFloat);
    check_shape(*exponentials, "exponentials", {b, v});
    TORCH_CHECK(exponentials->stride(1) == 1 || v == 1,
                "peagle: exponentials must have unit stride along the vocabulary, got strides ",
                c10::str(exponentials->strides()));
  }

  // Outputs.
  check_dtype(output_token_ids, "output_token_ids", at::kInt);
  check_dim(output_token_ids, "output_token_ids", 2);
  TORCH_CHECK(output_token_ids.size(0) == b && output_token_ids.size(1) >= 1,
              "peagle: output_token_ids must have shape [B, max_n + 1] = [", b, ", >= 1], got ",
              shape_str(output_token_ids));
  const int64_t max_n = output_token_ids.size(1) - 1;
  TORCH_CHECK(max_n < INT32_MAX, "peagle: output_token_ids is too wide");
  check_contiguous(output_token_ids, "output_token_ids");
  check_dtype(num_accepted, "num_accepted", at::kInt);
  check_shape(num_accepted, "num_accepted", {b});
  check_contiguous(num_accepted, "num_accepted");
  if (accepted_per_position) {
    check_dtype(*accepted_per_position, "accepted_per_position", at::kBool);
    check_shape(*accepted_per_position, "accepted_per_position", {b, max_n});
    check_contiguous(*accepted_per_position, "accepted_per_position");
  }

  // One device for everything.
  const char* ref = "target_logits";
  check_device(draft_token_ids, "draft_token_ids", target_logits, ref);
  check_device(cu_num_draft_tokens, "cu_num_draft_tokens", target_logits, ref);
  check_device(temperature, "temperature", target_logits, ref);
  check_device(seeds, "seeds", target_logits, ref);
  check_device(offsets, "offsets", target_logits, ref);
  check_device(output_token_ids, "output_token_ids", target_logits, ref);
  check_device(num_accepted, "num_accepted", target_logits, ref);
  if (top_k) check_device(*top_k, "top_k", target_logits, ref);
  if (top_p) check_device(*top_p, "top_p", target_logits, ref);
  if (draft_probs) check_device(*draft_probs, "draft_probs", target_logits, ref);
  if (uniforms) check_device(*uniforms, "uniforms", target_logits, ref);
  if (request_mask) check_device(*request_mask, "request_mask", target_logits, ref);
  if (bonus_token_ids) check_device(*bonus_token_ids, "bonus_token_ids", target_logits, ref);
  if (exponentials) check_device(*exponentials, "exponentials", target_logits, ref);
  if (accepted_per_position) {
    check_device(*accepted_per_position, "accepted_per_position", target_logits, ref);
  }

  p.logits = target_logits.data_ptr();
  p.logits_dtype = logits_dtype_of(target_logits.scalar_type());
  p.logits_row_stride = target_logits.stride(0);
  p.num_rows = t + b;
  p.vocab_size = static_cast<int32_t>(v);
  p.num_reqs = static_cast<int32_t>(b);
  p.num_draft_tokens = t;
  p.draft_token_ids = in(draft_token_ids).data_ptr<int32_t>();
  p.cu_num_draft_tokens = in(cu_num_draft_tokens).data_ptr<int32_t>();
  p.temperature = in(temperature).data_ptr<float>();
  p.seeds = in(seeds).data_ptr<int64_t>();
  p.offsets = in(offsets).data_ptr<int64_t>();
  p.top_k = top_k ? in(*top_k).data_ptr<int32_t>() : nullptr;
  p.top_p = top_p ? in(*top_p).data_ptr<float>() : nullptr;
  if (draft_probs) {
    p.draft_probs = draft_probs->data_ptr<float>();
    p.draft_probs_row_stride = draft_probs->stride(0);
  }
  p.uniforms = uniforms ? in(*uniforms).data_ptr<double>() : nullptr;
  p.request_mask = request_mask ? in(*request_mask).data_ptr<bool>() : nullptr;
  p.bonus_token_ids = bonus_token_ids ? in(*bonus_token_ids).data_ptr<int32_t>() : nullptr;
  if (exponentials) {
    p.exponentials = exponentials->data_ptr<float>();
    p.exponentials_row_stride = exponentials->stride(0);
  }
  p.output_token_ids = output_token_ids.data_ptr<int32_t>();
  p.max_num_draft_tokens = static_cast<int32_t>(max_n);
  p.num_accepted = num_accepted.data_ptr<int32_t>();
  p.accepted_per_position =
      accepted_per_position ? accepted_per_position->data_ptr<bool>() : nullptr;
  PEAGLE_RUN(verify_chain, p, target_logits);
}

PEAGLE_IMPL("verify_chain", &verify_chain);

}  // namespace peagle
