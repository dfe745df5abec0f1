// Top-p (nucleus) filtering of float32 logits without sorting the vocabulary, in place.
//
// The rule is the sampler's (worker/sampler.py, apply_top_k_top_p): rank tokens by logit, equal logits by descending
// token id; keep a token when the probability mass ranked above it is below p (the most likely token always stays);
// set the others to -inf. A sort of 49,152 logits costs ~5 ms per row on these CPUs; this costs a few passes:
//   1. each token's weight exp(x - max), in one vectorized loop;
//   2. a histogram of the weights by how far the logit lies below the max (buckets of 1/4 nat, the last one open);
//   3. the boundary bucket, where the mass of the buckets above reaches p: every token above it stays, every token
//      below it goes (the boundary's tokens and those above already hold p), and only the boundary's few tokens are
//      sorted to find the cut;
//   4. one pass that masks everything ranked past the cut.
// Masked logits (-inf) are recognised by comparison with a large finite bound: the file builds with -ffast-math,
// under which a compiler may assume no infinities, so nothing here tests for one directly.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kBuckets = 64;
constexpr float kBucketsPerNat = 4.0f;
constexpr float kMasked = -3.0e38f;  // a logit at or below this is masked
constexpr float kLowestExponent = -100.0f;  // exp of anything further below the max is 0 in float32 anyway

float negative_infinity() {
  const uint32_t bits = 0xff800000u;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

struct Candidate {
  float logit;
  int64_t id;
  float weight;
};

struct Scratch {
  std::vector<float> weights;
  std::vector<uint8_t> buckets;
  std::vector<Candidate> boundary;
};

void top_p_row(float* x, int64_t vocab, double p, Scratch& s) {
  float top = kMasked;
  for (int64_t j = 0; j < vocab; ++j) top = std::max(top, x[j]);
  if (!(top > kMasked)) return;  // nothing left to keep: the sampler gives such a row the model's own choice

  s.weights.resize(vocab);
  s.buckets.resize(vocab);
  float* w = s.weights.data();
  const float floor = top + kLowestExponent;
  for (int64_t j = 0; j < vocab; ++j) w[j] = std::exp(std::max(x[j], floor) - top);

  double mass[kBuckets] = {0.0};
  uint8_t* bucket = s.buckets.data();
  for (int64_t j = 0; j < vocab; ++j) {
    if (x[j] > kMasked) {
      // Clamped as an integer: a NaN logit (a model that overflowed) converts to some integer under -ffast-math,
      // and must still land in a bucket rather than outside the array.
      const float below = std::min((top - x[j]) * kBucketsPerNat, float(kBuckets - 1));
      const int b = std::clamp(int(below), 0, kBuckets - 1);
      bucket[j] = uint8_t(b);
      mass[b] += w[j];
    } else {
      bucket[j] = uint8_t(kBuckets);  // in no bucket: never a candidate, always masked
    }
  }
  double total = 0.0;
  for (double m : mass) total += m;
  const double target = p * total;
  int boundary = 0;
  double above_boundary = 0.0;
  while (boundary < kBuckets - 1 && above_boundary + mass[boundary] < target) above_boundary += mass[boundary++];

  s.boundary.clear();
  for (int64_t j = 0; j < vocab; ++j) {
    if (bucket[j] == boundary) s.boundary.push_back({x[j], j, w[j]});
  }
  std::sort(s.boundary.begin(), s.boundary.end(), [](const Candidate& a, const Candidate& b) {
    return a.logit != b.logit ? a.logit > b.logit : a.id > b.id;
  });
  double above = above_boundary;
  size_t kept = 0;
  while (kept < s.boundary.size() && (kept == 0 || above < target)) above += s.boundary[kept++].weight;
  if (kept == 0) return;  // an empty boundary cannot hold the mass that reaches p; keep the row as it is
  const float cut = s.boundary[kept - 1].logit;
  const int64_t cut_id = s.boundary[kept - 1].id;
  const float dropped = negative_infinity();
  for (int64_t j = 0; j < vocab; ++j) {
    if (x[j] < cut || (x[j] == cut && j < cut_id)) x[j] = dropped;
  }
}

void top_p_mask(const at::Tensor& logits, const at::Tensor& top_p) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "top_p_mask: float32 rows, contiguous");
  TORCH_CHECK(top_p.scalar_type() == at::kFloat && top_p.dim() == 1 && top_p.size(0) == logits.size(0) &&
                  top_p.is_contiguous(),
              "top_p_mask: one float32 top_p per row");
  const int64_t vocab = logits.size(1), row_stride = logits.stride(0);
  float* data = logits.data_ptr<float>();
  const float* ps = top_p.data_ptr<float>();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t row = begin; row < end; ++row) {
      if (ps[row] < 1.0f) top_p_row(data + row * row_stride, vocab, ps[row], scratch);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmserve, m) { m.def("top_p_mask(Tensor(a!) logits, Tensor top_p) -> ()"); }

TORCH_LIBRARY_IMPL(lmserve, CPU, m) { m.impl("top_p_mask", &top_p_mask); }
