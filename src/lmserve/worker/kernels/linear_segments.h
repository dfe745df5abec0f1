// A linear layer as the kernels' programs call it: one or more products over consecutive output rows, each a block
// kernel's (reached through the dispatcher, so that it is the very op the eager forward calls) or fbgemm's on float16
// weights. Shared by LayerProgram (layer_program.cpp) and MoeBlock (moe_block.h).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <vector>

namespace lmserve_program {

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&);
using SiluMulFn = void(const at::Tensor&, const at::Tensor&);

template <class Fn>
inline c10::TypedOperatorHandle<Fn> op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Fn>();
}

// fbgemm's float16-weight product (batched_copies.Float16WeightLinear): its weights are a packed-params object, so
// the call is boxed.
inline at::Tensor fbgemm_fp16(const at::Tensor& x, const c10::IValue& packed) {
  static const c10::OperatorHandle handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_dynamic_fp16", "");
  torch::jit::Stack stack{x, packed};
  handle.callBoxed(stack);
  return stack[0].toTensor();
}

// One product over some output rows: a block kernel's (a layer stored in several formats is several, over
// consecutive rows), or fbgemm's on float16 weights.
struct Segment {
  std::optional<c10::TypedOperatorHandle<LinearFn>> op;  // the block kernel; none for fbgemm
  at::Tensor weight;
  c10::IValue packed;  // fbgemm's weights
  int64_t out_features = 0, in_features = 0, row_tile = 1;
  std::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    if (op) return op->call(x, weight, out_features, bias);
    // Float16WeightLinear.forward: rows padded with zero rows to a multiple of row_tile, the bias added after.
    const at::Tensor rows = x.reshape({-1, in_features});
    const int64_t padding = (row_tile - rows.size(0) % row_tile) % row_tile;
    at::Tensor y;
    if (padding == 0) {
      y = fbgemm_fp16(x.contiguous(), packed);
    } else {
      const at::Tensor padded = at::cat({rows, at::zeros({padding, in_features}, rows.options())});
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
      shape.back() = out_features;
      y = fbgemm_fp16(padded, packed).slice(0, 0, rows.size(0)).reshape(shape);
    }
    return bias ? y.add_(*bias) : y;
  }
};

struct Linear {
  std::vector<Segment> segments;

  at::Tensor operator()(const at::Tensor& x) const {
    TORCH_CHECK(!segments.empty(), "a linear layer without its weights");
    if (segments.size() == 1) return segments[0](x);
    std::vector<at::Tensor> parts;
    parts.reserve(segments.size());
    for (const Segment& s : segments) parts.push_back(s(x));
    return at::cat(parts, -1);
  }
};

inline Segment kernel_segment(const std::string& op_name, at::Tensor weight, int64_t out_features,
                              std::optional<at::Tensor> bias) {
  Segment segment;
  segment.op = op<LinearFn>(op_name);
  segment.weight = std::move(weight);
  segment.out_features = out_features;
  segment.bias = std::move(bias);
  return segment;
}

// fbgemm's float16 weights (`packed`: torch.ops.quantized.linear_prepack_fp16's object).
inline Segment fp16_segment(c10::IValue packed, int64_t in_features, int64_t out_features, int64_t row_tile,
                            std::optional<at::Tensor> bias) {
  TORCH_CHECK(row_tile > 0, "row_tile must be positive");
  Segment segment;
  segment.packed = std::move(packed);
  segment.in_features = in_features;
  segment.out_features = out_features;
  segment.row_tile = row_tile;
  segment.bias = std::move(bias);
  return segment;
}

}  // namespace lmserve_program
