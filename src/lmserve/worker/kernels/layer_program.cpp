// A model's decoder layers as one call from Python: the CPU's answer to CUDA graphs.
//
// A decode step of a small model spends a quarter of its time in Python between ops (Gemma 3 270M: ~100 us a layer
// around ~130 us of kernels). LayerProgram holds each layer's weights and settings once and runs the same ops, in the
// same order, on the same tensors as the eager forward of worker/models/llama.py (DecoderLayer, SandwichDecoderLayer
// with fused ops, paged-cpu attention, linear layers on block formats or fbgemm's float16 weights). Each op is
// reached through the dispatcher, so every kernel is the one the eager path calls and a row's result is the same bits either way
// (tests/worker/test_layer_program.py). worker/layer_program.py decides when a batch may take it.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "linear_segments.h"
#include "moe_block.h"

#include <optional>
#include <string>
#include <vector>

namespace {

using namespace lmserve_program;

using NormFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using AddNormFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using RotaryFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
using WriteFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using AttentionFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, double, int64_t, double, const std::optional<at::Tensor>&);

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
  c10::intrusive_ptr<MoeBlock> moe;  // a mixture-of-experts block in place of gate_up, down
  bool full_qk_norm = false;  // q_norm and k_norm over all heads at once (OLMoE), not each head
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
    slot_of(slot).segments.push_back(kernel_segment(op_name, std::move(weight), out_features, std::move(bias)));
  }

  // The same for fbgemm's float16 weights.
  void add_fp16_segment(const std::string& slot, c10::IValue packed, int64_t in_features, int64_t out_features,
                        int64_t row_tile, std::optional<at::Tensor> bias) {
    slot_of(slot).segments.push_back(
        fp16_segment(std::move(packed), in_features, out_features, row_tile, std::move(bias)));
  }

  // The last layer added's q and k norms weigh all heads at once (OLMoE's), not each head alone.
  void set_full_qk_norm() {
    TORCH_CHECK(!layers.empty() && layers.back().q_norm, "LayerProgram: add a layer with q/k norms first");
    layers.back().full_qk_norm = true;
  }

  // The last layer added's feed-forward block is a mixture of experts (its gate_up and down slots stay empty).
  void set_moe(c10::intrusive_ptr<MoeBlock> block) {
    TORCH_CHECK(!layers.empty(), "LayerProgram: add_layer first");
    layers.back().moe = std::move(block);
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
      at::Tensor qkv = layer.qkv(x);
      if (layer.full_qk_norm) {  // Attention.forward's: each norm over a contiguous copy, written back
        const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
        const std::pair<int64_t, const at::Tensor*> parts[2] = {{0, &*layer.q_norm}, {q_size, &*layer.k_norm}};
        for (const auto& [start, weight] : parts) {
          at::Tensor part = qkv.slice(1, start, start + (start == 0 ? q_size : kv_size));
          const at::Tensor source = part.contiguous();
          at::Tensor normed = at::empty_like(source);
          rms_norm.call(normed, source, *weight, eps);
          part.copy_(normed);
        }
      }
      qkv = qkv.view({-1, heads + 2 * kv_heads, head_dim});
      if (layer.q_norm && !layer.full_qk_norm) {
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
                       layer.scale, layer.window, layer.softcap, std::nullopt);
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
      at::Tensor down;
      if (layer.moe) {
        down = layer.moe->forward(x);
      } else {
        at::Tensor gate_up = layer.gate_up(x);
        at::Tensor activated;
        if (gelu) {
          std::vector<at::Tensor> halves = gate_up.split(intermediate, -1);
          activated = at::gelu(halves[0], "tanh") * halves[1];
        } else {
          activated = at::empty({gate_up.size(0), intermediate}, gate_up.options());
          silu_and_mul.call(activated, gate_up);
        }
        down = layer.down(activated);
      }
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

// slot_out float32 [tokens * k, hidden] (slot t k + j: token t's j-th expert's output), scale float32 [tokens, k] ->
// [tokens, hidden]: MoeBlock's sum (moe_block.h's combine_slots), for worker/models/moe.py's loop.
at::Tensor moe_combine(const at::Tensor& slot_out, const at::Tensor& scale) {
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kFloat, "moe_combine: scale must be float32 [tokens, k]");
  const int64_t tokens = scale.size(0), k = scale.size(1);
  TORCH_CHECK(slot_out.dim() == 2 && slot_out.scalar_type() == at::kFloat && slot_out.size(0) == tokens * k,
              "moe_combine: slot_out must be float32 [tokens * k, hidden]");
  const at::Tensor rows = slot_out.contiguous(), scales = scale.contiguous();
  const int64_t hidden = rows.size(1);
  std::vector<const float*> slot_row(tokens * k);
  for (int64_t s = 0; s < tokens * k; ++s) slot_row[s] = rows.data_ptr<float>() + s * hidden;
  at::Tensor out = at::empty({tokens, hidden}, rows.options());
  lmserve_program::combine_slots(slot_row, scales.data_ptr<float>(), tokens, k, hidden, out.data_ptr<float>());
  return out;
}

TORCH_LIBRARY_FRAGMENT(lmserve, m) {
  m.def("moe_combine(Tensor slot_out, Tensor scale) -> Tensor", &moe_combine);
  m.class_<MoeBlock>("MoeBlock")
      .def(torch::init<int64_t, int64_t, int64_t, bool, bool, at::Tensor, std::optional<at::Tensor>, at::Tensor>())
      .def("add_segment", &MoeBlock::add_segment)
      .def("add_fp16_segment", &MoeBlock::add_fp16_segment)
      .def("forward", &MoeBlock::forward);
  m.class_<LayerProgram>("LayerProgram")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, bool, bool>())
      .def("add_layer", &LayerProgram::add_layer)
      .def("add_segment", &LayerProgram::add_segment)
      .def("add_fp16_segment", &LayerProgram::add_fp16_segment)
      .def("set_moe", &LayerProgram::set_moe)
      .def("set_full_qk_norm", &LayerProgram::set_full_qk_norm)
      .def("run", &LayerProgram::run);
}
