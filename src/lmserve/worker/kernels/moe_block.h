// A mixture-of-experts feed-forward block as one call: route, group the step's tokens by expert, run each active
// expert's gate_up, activation and down once over its tokens, and sum each token's experts, weighted, in its own
// top-k order. The same ops, in the same order, on the same tensors as worker/models/moe.py's SparseMoeBlock in
// Python, so a token gets the same bits either way (tests/worker/test_moe.py), and the same batch invariance: a
// token's result depends on its own routing alone.
//
// Python around ~40 active experts a layer (eight decodes) cost more than their kernels; here the loop over experts
// is C++, and LayerProgram (layer_program.cpp) runs the block inside a decode step's single call.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "linear_segments.h"

namespace lmserve_program {

// A token's experts summed in its own top-k order: out[t] = sum over j of scale[t, j] rows[t k + j] (j = 0 first, then
// one FMA per further j), each token alone, so its bits do not depend on the other tokens. `rows[s]`: slot s's output
// row, wherever it lies (an expert's own output: no scatter into a slot-ordered copy first). MoeBlock and the
// `moe_combine` op (worker/models/moe.py's loop) both call this one function, so they agree to the bit.
__attribute__((noinline)) inline void combine_slots(const std::vector<const float*>& rows, const float* scale,
                                                    int64_t tokens, int64_t k, int64_t hidden, float* out) {
  at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k * hidden)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = out + t * hidden;
      const float* first = rows[t * k];
      const float s0 = scale[t * k];
#pragma omp simd
      for (int64_t h = 0; h < hidden; ++h) o[h] = first[h] * s0;
      for (int64_t j = 1; j < k; ++j) {
        const float* r = rows[t * k + j];
        const float sj = scale[t * k + j];
#pragma omp simd
        for (int64_t h = 0; h < hidden; ++h) o[h] = std::fma(r[h], sj, o[h]);
      }
    }
  });
}

// One expert's MLP (or the shared expert's): gate_up, then SiLU or GELU(tanh) of the gate times up, then down.
struct ExpertMlp {
  Linear gate_up, down;
  bool present() const { return !gate_up.segments.empty() && !down.segments.empty(); }
};

struct MoeBlock : torch::CustomClassHolder {
  int64_t top_k, intermediate, shared_intermediate;
  bool normalize_top_k, gelu;
  at::Tensor router;                        // float64 [experts, hidden]: RouterWeight's (worker/models/moe.py)
  std::optional<at::Tensor> shared_router;  // float64 [1, hidden]: the shared expert's sigmoid gate
  at::Tensor routed_tokens;                 // int64 [experts]: tokens routed to each expert so far (Python reads it)
  std::vector<ExpertMlp> experts;           // absent: held by another rank (expert parallel)
  ExpertMlp shared;
  c10::TypedOperatorHandle<SiluMulFn> silu_and_mul = op<SiluMulFn>("lmserve::silu_and_mul");

  MoeBlock(int64_t top_k, int64_t intermediate, int64_t shared_intermediate, bool normalize_top_k, bool gelu,
           at::Tensor router, std::optional<at::Tensor> shared_router, at::Tensor routed_tokens)
      : top_k(top_k), intermediate(intermediate), shared_intermediate(shared_intermediate),
        normalize_top_k(normalize_top_k), gelu(gelu), router(std::move(router)),
        shared_router(std::move(shared_router)), routed_tokens(std::move(routed_tokens)) {
    TORCH_CHECK(this->router.dim() == 2 && this->router.scalar_type() == at::kDouble, "MoeBlock: a float64 router");
    TORCH_CHECK(top_k > 0 && top_k <= this->router.size(0), "MoeBlock: top_k out of range");
    TORCH_CHECK(this->routed_tokens.scalar_type() == at::kLong && this->routed_tokens.numel() == this->router.size(0),
                "MoeBlock: routed_tokens must be int64 [experts]");
    TORCH_CHECK(this->shared_router.has_value() == (shared_intermediate > 0),
                "MoeBlock: a shared expert and its gate go together");
    experts.resize(this->router.size(0));
  }

  // expert: -1 for the shared expert; slot: gate_up or down.
  Linear& slot_of(int64_t expert, const std::string& slot) {
    TORCH_CHECK(expert >= -1 && expert < static_cast<int64_t>(experts.size()), "MoeBlock: no expert ", expert);
    ExpertMlp& mlp = expert < 0 ? shared : experts[expert];
    TORCH_CHECK(slot == "gate_up" || slot == "down", "MoeBlock: unknown slot ", slot);
    return slot == "gate_up" ? mlp.gate_up : mlp.down;
  }

  void add_segment(int64_t expert, const std::string& slot, const std::string& op_name, at::Tensor weight,
                   int64_t out_features, std::optional<at::Tensor> bias) {
    slot_of(expert, slot).segments.push_back(kernel_segment(op_name, std::move(weight), out_features, std::move(bias)));
  }

  void add_fp16_segment(int64_t expert, const std::string& slot, c10::IValue packed, int64_t in_features,
                        int64_t out_features, int64_t row_tile, std::optional<at::Tensor> bias) {
    slot_of(expert, slot).segments.push_back(
        fp16_segment(std::move(packed), in_features, out_features, row_tile, std::move(bias)));
  }

  // models/layers.py's MLP.forward with fused ops.
  at::Tensor mlp(const ExpertMlp& expert, int64_t width, const at::Tensor& x) const {
    const at::Tensor gate_up = expert.gate_up(x);
    at::Tensor hidden;
    if (gelu) {
      const std::vector<at::Tensor> halves = gate_up.split(width, -1);
      hidden = at::gelu(halves[0], "tanh") * halves[1];
    } else {
      hidden = at::empty({gate_up.size(0), width}, gate_up.options());
      silu_and_mul.call(hidden, gate_up);
    }
    return expert.down(hidden);
  }

  // x [tokens, hidden] -> this rank's share of the block's output (the caller all-reduces under tensor parallel).
  at::Tensor forward(const at::Tensor& x) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "MoeBlock: x must be float32 [tokens, hidden]");
    const int64_t tokens = x.size(0), k = top_k, hidden = x.size(1);
    // RouterWeight.forward, softmax, top-k (highest first) and SparseMoeBlock.route's normalisation.
    const at::Tensor probs = at::softmax(at::matmul(x.to(at::kDouble), router.t()).to(at::kFloat), -1);
    auto [weights, chosen] = at::topk(probs, k, -1, true, true);
    if (normalize_top_k) weights = weights / weights.sum(-1, true);
    routed_tokens.add_(at::bincount(chosen.flatten(), {}, router.size(0)));
    const at::Tensor scale = weights.to(x.scalar_type()).contiguous();

    // Slot s = t * k + j: token t's j-th choice; each expert's slots in token order.
    const at::Tensor choices = chosen.contiguous();
    const int64_t* choice = choices.data_ptr<int64_t>();
    std::vector<std::vector<int64_t>> slots(experts.size());
    for (int64_t s = 0; s < tokens * k; ++s) slots[choice[s]].push_back(s);
    // Every present expert's token rows gathered in one copy, expert after expert: each expert's input is a run of
    // consecutive rows of it (one decode: x itself, every expert it chose).
    std::vector<int64_t> first_row(experts.size(), 0), token_of;
    token_of.reserve(tokens * k);
    for (size_t e = 0; e < experts.size(); ++e) {
      first_row[e] = static_cast<int64_t>(token_of.size());
      if (!experts[e].present()) continue;
      for (int64_t s : slots[e]) token_of.push_back(s / k);
    }
    const auto index_options = at::TensorOptions().dtype(at::kLong);
    const at::Tensor grouped =
        tokens == 1 || token_of.empty()
            ? x
            : x.index_select(0, at::from_blob(token_of.data(), {static_cast<int64_t>(token_of.size())}, index_options));
    // Each slot's output row where its expert wrote it; an expert another rank holds adds nothing here (zeros).
    const std::vector<float> zeros(hidden, 0.0f);
    std::vector<const float*> slot_row(tokens * k, zeros.data());
    std::vector<at::Tensor> outputs;
    for (size_t e = 0; e < experts.size(); ++e) {
      const std::vector<int64_t>& mine = slots[e];
      if (mine.empty() || !experts[e].present()) continue;
      const int64_t count = static_cast<int64_t>(mine.size());
      const at::Tensor rows = tokens == 1 ? x : grouped.narrow(0, first_row[e], count);
      outputs.push_back(mlp(experts[e], intermediate, rows).contiguous());
      const float* y = outputs.back().data_ptr<float>();
      for (int64_t i = 0; i < count; ++i) slot_row[mine[i]] = y + i * hidden;
    }
    at::Tensor out = at::empty({tokens, hidden}, x.options());
    combine_slots(slot_row, scale.data_ptr<float>(), tokens, k, hidden, out.data_ptr<float>());
    if (shared.present()) {
      const at::Tensor gate = at::sigmoid(at::matmul(x.to(at::kDouble), shared_router->t()).to(at::kFloat));
      out.add_(mlp(shared, shared_intermediate, x) * gate.to(x.scalar_type()));
    }
    return out;
  }
};

}  // namespace lmserve_program
