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
#include <torch/custom_class.h>

#include <optional>
#include <string>
#include <vector>

#include "linear_segments.h"

namespace lmserve_program {

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
    TORCH_CHECK(x.dim() == 2, "MoeBlock: x must be [tokens, hidden]");
    const int64_t tokens = x.size(0), k = top_k, hidden = x.size(1);
    // RouterWeight.forward, softmax, top-k (highest first) and SparseMoeBlock.route's normalisation.
    const at::Tensor probs = at::softmax(at::matmul(x.to(at::kDouble), router.t()).to(at::kFloat), -1);
    auto [weights, chosen] = at::topk(probs, k, -1, true, true);
    if (normalize_top_k) weights = weights / weights.sum(-1, true);
    routed_tokens.add_(at::bincount(chosen.flatten(), {}, router.size(0)));
    const at::Tensor scale = weights.to(x.scalar_type());

    // Slot s = t * k + j: token t's j-th choice; each expert's slots in token order.
    const at::Tensor choices = chosen.contiguous();
    const int64_t* choice = choices.data_ptr<int64_t>();
    std::vector<std::vector<int64_t>> slots(experts.size());
    bool every_chosen_present = true;
    for (int64_t s = 0; s < tokens * k; ++s) {
      slots[choice[s]].push_back(s);
      every_chosen_present = every_chosen_present && experts[choice[s]].present();
    }
    // An expert another rank holds adds nothing here: its slots stay zero.
    at::Tensor slot_out = every_chosen_present ? at::empty({tokens * k, hidden}, x.options())
                                               : at::zeros({tokens * k, hidden}, x.options());
    const auto index_options = at::TensorOptions().dtype(at::kLong);
    for (size_t e = 0; e < experts.size(); ++e) {
      const std::vector<int64_t>& mine = slots[e];
      if (mine.empty() || !experts[e].present()) continue;
      const int64_t count = static_cast<int64_t>(mine.size());
      at::Tensor rows;
      if (count == tokens) {
        rows = x;  // every token chose this expert (one decode: every expert it chose)
      } else {
        std::vector<int64_t> token_of(mine.size());
        for (size_t i = 0; i < mine.size(); ++i) token_of[i] = mine[i] / k;
        rows = x.index_select(0, at::from_blob(token_of.data(), {count}, index_options).clone());
      }
      const at::Tensor y = mlp(experts[e], intermediate, rows);
      slot_out.index_copy_(0, at::from_blob(const_cast<int64_t*>(mine.data()), {count}, index_options).clone(), y);
    }
    const at::Tensor by_choice = slot_out.view({tokens, k, hidden});
    at::Tensor out = by_choice.select(1, 0) * scale.slice(1, 0, 1);
    for (int64_t j = 1; j < k; ++j) out.addcmul_(by_choice.select(1, j), scale.slice(1, j, j + 1));
    if (shared.present()) {
      const at::Tensor gate = at::sigmoid(at::matmul(x.to(at::kDouble), shared_router->t()).to(at::kFloat));
      out.add_(mlp(shared, shared_intermediate, x) * gate.to(x.scalar_type()));
    }
    return out;
  }
};

}  // namespace lmserve_program
