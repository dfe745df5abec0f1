// A model's decoder layers as one call from Python: the CPU's answer to CUDA graphs.
//
// A decode step of a small model spends a quarter of its time in Python between ops (Gemma 3 270M: ~100 us a layer
// around ~130 us of kernels). LayerProgram holds each layer's weights and settings once and runs the same ops, in the
// same order, on the same tensors as the eager forward of worker/models/llama.py (DecoderLayer, SandwichDecoderLayer
// with fused ops, paged-cpu attention, linear layers on block formats or fbgemm's float16 weights). Each op is
// reached through the dispatcher, so every kernel is the one the eager path calls and a row's result is the same bits either way
// (tests/worker/test_layer_program.py). worker/layer_program.py decides when a batch may take it.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace {

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&);
using NormFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using AddNormFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using RotaryFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
using WriteFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using AttentionFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, double, int64_t, double);
using SiluMulFn = void(const at::Tensor&, const at::Tensor&);

template <class Fn>
c10::TypedOperatorHandle<Fn> op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Fn>();
}

// fbgemm's float16-weight product (batched_copies.Float16WeightLinear): its weights are a packed-params object, so
// the call is boxed.
at::Tensor fbgemm_fp16(const at::Tensor& x, const c10::IValue& packed) {
  static const c10::OperatorHandle handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_dynamic_fp16", "");
  torch::jit::Stack stack{x, packed};
  handle.callBoxed(stack);
  return stack[0].toTensor();
}

// worker/models/llama.py's apply_rotary: rotate-half RoPE in float32 over the first 2 * width dimensions of each head
// (width: the tables' last size), the rest passed through (partial rotary, as Phi-4-mini's).
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t width = cos.size(-1);
  if (2 * width < x.size(-1)) {
    return at::cat({apply_rotary(x.slice(-1, 0, 2 * width), cos, sin), x.slice(-1, 2 * width)}, -1);
  }
  const std::vector<at::Tensor> halves = x.to(at::kFloat).chunk(2, -1);
  return at::cat({halves[0] * cos - halves[1] * sin, halves[1] * cos + halves[0] * sin}, -1).to(x.scalar_type());
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
    TORCH_CHECK(!segments.empty(), "LayerProgram: a layer without its weights");
    if (segments.size() == 1) return segments[0](x);
    std::vector<at::Tensor> parts;
    parts.reserve(segments.size());
    for (const Segment& s : segments) parts.push_back(s(x));
    return at::cat(parts, -1);
  }
};

struct Layer {
  Linear qkv, o, gate_up, down;
  std::vector<at::Tensor> norms;  // input, post-attention; a sandwich layer's pre- and post-feedforward too
  std::optional<at::Tensor> q_norm, k_norm;
  int64_t rope = 0;   // which of run()'s cos/sin tables
  bool full_rotary = true;  // RoPE over whole heads (the fused op); else apply_rotary
  int64_t group = 0;  // which KV-cache group's rows and tables
  double scale = 1.0;
  int64_t window = 0;
  double softcap = 0.0;
  at::Tensor k_cache, v_cache;
};

struct LayerProgram : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim, intermediate;
  double eps;
  bool sandwich, gelu;
  std::vector<Layer> layers;
  c10::TypedOperatorHandle<NormFn> rms_norm = op<NormFn>("lmserve::rms_norm");
  c10::TypedOperatorHandle<AddNormFn> add_rms_norm = op<AddNormFn>("lmserve::fused_add_rms_norm");
  c10::TypedOperatorHandle<RotaryFn> rotary = op<RotaryFn>("lmserve::rotary_embedding");
  c10::TypedOperatorHandle<WriteFn> write_kv = op<WriteFn>("lmserve::write_kv_cache");
  c10::TypedOperatorHandle<AttentionFn> attention = op<AttentionFn>("lmserve::paged_attention");
  c10::TypedOperatorHandle<SiluMulFn> silu_and_mul = op<SiluMulFn>("lmserve::silu_and_mul");

  LayerProgram(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps, bool sandwich,
               bool gelu)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), intermediate(intermediate), eps(eps),
        sandwich(sandwich), gelu(gelu) {}

  void add_layer(std::vector<at::Tensor> norms, std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 int64_t rope, bool full_rotary, int64_t group, double scale, int64_t window, double softcap,
                 at::Tensor k_cache, at::Tensor v_cache) {
    TORCH_CHECK(norms.size() == (sandwich ? 4u : 2u), "LayerProgram: ", sandwich ? 4 : 2, " norms a layer");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "LayerProgram: q and k norms go together");
    Layer layer;
    layer.norms = std::move(norms);
    layer.q_norm = std::move(q_norm);
    layer.k_norm = std::move(k_norm);
    layer.rope = rope;
    layer.full_rotary = full_rotary;
    layer.group = group;
    layer.scale = scale;
    layer.window = window;
    layer.softcap = softcap;
    layer.k_cache = std::move(k_cache);
    layer.v_cache = std::move(v_cache);
    layers.push_back(std::move(layer));
  }

  // slot: qkv, o, gate_up or down of the last layer added; op: the block kernel's name (lmserve::q4_k_int16_linear).
  void add_segment(const std::string& slot, const std::string& op_name, at::Tensor weight, int64_t out_features,
                   std::optional<at::Tensor> bias) {
    Segment segment;
    segment.op = op<LinearFn>(op_name);
    segment.weight = std::move(weight);
    segment.out_features = out_features;
    segment.bias = std::move(bias);
    slot_of(slot).segments.push_back(std::move(segment));
  }

  // The same for fbgemm's float16 weights (`packed`: torch.ops.quantized.linear_prepack_fp16's object).
  void add_fp16_segment(const std::string& slot, c10::IValue packed, int64_t in_features, int64_t out_features,
                        int64_t row_tile, std::optional<at::Tensor> bias) {
    TORCH_CHECK(row_tile > 0, "LayerProgram: row_tile must be positive");
    Segment segment;
    segment.packed = std::move(packed);
    segment.in_features = in_features;
    segment.out_features = out_features;
    segment.row_tile = row_tile;
    segment.bias = std::move(bias);
    slot_of(slot).segments.push_back(std::move(segment));
  }

  Linear& slot_of(const std::string& slot) {
    TORCH_CHECK(!layers.empty(), "LayerProgram: add_layer first");
    Layer& layer = layers.back();
    Linear* linear = slot == "qkv" ? &layer.qkv : slot == "o" ? &layer.o : slot == "gate_up" ? &layer.gate_up
                   : slot == "down" ? &layer.down : nullptr;
    TORCH_CHECK(linear != nullptr, "LayerProgram: unknown slot ", slot);
    return *linear;
  }

  // x: the embeddings [T, hidden] (residual absent) or a previous stage's output. cos/sin: per RoPE table; rows,
  // tables, requests: per KV-cache group (AttentionMetadata.cache_rows, decode_block_tables, decode_requests).
  // Returns the last layer's output and the residual stream, as the eager loop leaves them.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor x, std::optional<at::Tensor> residual_in,
                                         std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                                         std::vector<at::Tensor> rows, std::vector<at::Tensor> tables,
                                         std::vector<at::Tensor> requests) const {
    const int64_t qk_heads = heads + kv_heads;
    bool has_residual = residual_in.has_value();
    at::Tensor residual = has_residual ? *residual_in : at::Tensor();
    for (const Layer& layer : layers) {
      if (!has_residual) {  // the first layer: RMSNorm(x), with x itself the residual stream
        residual = x;
        at::Tensor normed = at::empty_like(x);
        rms_norm.call(normed, x, layer.norms[0], eps);
        x = normed;
        has_residual = true;
      } else {
        add_rms_norm.call(x, residual, layer.norms[0], eps);
      }
      at::Tensor qkv = layer.qkv(x).view({-1, heads + 2 * kv_heads, head_dim});
      if (layer.q_norm) {
        at::Tensor q = qkv.slice(1, 0, heads), k = qkv.slice(1, heads, qk_heads);
        rms_norm.call(q, q, *layer.q_norm, eps);
        rms_norm.call(k, k, *layer.k_norm, eps);
      }
      std::vector<at::Tensor> qkv_parts;
      if (layer.full_rotary) {
        rotary.call(qkv, cos[layer.rope], sin[layer.rope], qk_heads);
        qkv_parts = qkv.split_with_sizes({heads, kv_heads, kv_heads}, 1);
      } else {
        const std::vector<at::Tensor> qk_v = qkv.split_with_sizes({qk_heads, kv_heads}, 1);
        qkv_parts = apply_rotary(qk_v[0], cos[layer.rope], sin[layer.rope]).split_with_sizes({heads, kv_heads}, 1);
        qkv_parts.push_back(qk_v[1]);
      }
      write_kv.call(layer.k_cache, layer.v_cache, qkv_parts[1], qkv_parts[2], rows[layer.group]);
      at::Tensor attended = at::empty_like(qkv_parts[0]);
      const at::Tensor& group_requests = requests[layer.group];
      if (group_requests.size(0) > 0) {
        attention.call(attended, qkv_parts[0], layer.k_cache, layer.v_cache, tables[layer.group], group_requests,
                       layer.scale, layer.window, layer.softcap);
      }
      at::Tensor out = layer.o(attended.reshape({-1, heads * head_dim}));
      if (sandwich) {
        at::Tensor normed = at::empty_like(out);
        rms_norm.call(normed, out, layer.norms[1], eps);
        add_rms_norm.call(normed, residual, layer.norms[2], eps);
        x = normed;
      } else {
        add_rms_norm.call(out, residual, layer.norms[1], eps);
        x = out;
      }
      at::Tensor gate_up = layer.gate_up(x);
      at::Tensor activated;
      if (gelu) {
        std::vector<at::Tensor> halves = gate_up.split(intermediate, -1);
        activated = at::gelu(halves[0], "tanh") * halves[1];
      } else {
        activated = at::empty({gate_up.size(0), intermediate}, gate_up.options());
        silu_and_mul.call(activated, gate_up);
      }
      at::Tensor down = layer.down(activated);
      if (sandwich) {
        x = at::empty_like(down);
        rms_norm.call(x, down, layer.norms[3], eps);
      } else {
        x = down;
      }
    }
    return {x, residual};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmserve, m) {
  m.class_<LayerProgram>("LayerProgram")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, bool, bool>())
      .def("add_layer", &LayerProgram::add_layer)
      .def("add_segment", &LayerProgram::add_segment)
      .def("add_fp16_segment", &LayerProgram::add_fp16_segment)
      .def("run", &LayerProgram::run);
}
