// Float32 CPU versions of the small per-layer steps of a Llama layer, each one op instead of several.
//
// A decode step of a small model runs ~40 PyTorch ops per layer, and on CPU each costs its dispatch (a few
// microseconds), an output allocation and a pass over memory. These three replace ten or so of them per layer:
//   fused_add_rms_norm: residual += x; x = rms_norm(residual) * weight (in place, vLLM's fused add-norm)
//   silu_and_mul:       out = silu(x[:, :I]) * x[:, I:]
//   rotary_embedding:   rotate-half RoPE of the first num_heads heads of a [T, heads, D] view, in place
// Rows are split over torch's intra-op threads only when there is enough work to pay for waking them.
//
// Each op's work on one row is a function of its own that is never inlined. at::parallel_for calls its body inline
// when the rows fit one task and through the thread pool otherwise, and GCC compiled the two copies of an inlined
// body differently (-ffast-math lets it reorder a sum of squares): a row's norm then changed in its last bit between
// a batch of 113 rows and one of 114, and a seeded token with it. One copy of the row code gives each row the same
// bits in any batch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kFloatsPerTask = 1 << 16;  // below this much work per thread, stay on the calling thread

int64_t grain(int64_t floats_per_row) { return std::max<int64_t>(1, kFloatsPerTask / std::max<int64_t>(1, floats_per_row)); }

void check_float_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, ": float32 only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": a 2-D tensor with contiguous rows");
}

__attribute__((noinline)) void add_rms_norm_row(float* xr, float* rr, const float* w, int64_t hidden, double eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < hidden; ++i) {
    const float v = rr[i] + xr[i];
    rr[i] = v;
    squares += v * v;
  }
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) xr[i] = rr[i] * inv * w[i];
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_float_rows(x, "fused_add_rms_norm x");
  check_float_rows(residual, "fused_add_rms_norm residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "fused_add_rms_norm: shapes");
  const int64_t hidden = x.size(1);
  float* xs = x.data_ptr<float>();
  float* rs = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t x_row = x.stride(0), r_row = residual.stride(0);
  at::parallel_for(0, x.size(0), grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) add_rms_norm_row(xs + t * x_row, rs + t * r_row, w, hidden, eps);
  });
}

// The sum of squares in 16 lanes by index, added up in a fixed order: the same bits wherever the row starts. (A
// `simd reduction` loop peels its first elements up to an aligned address, so a row's sum changed with its
// address, and x here may come from NumPy, which aligns to 16 bytes: a prompt's tokens then differed between a
// chunked prefill and one step.)
__attribute__((noinline)) float sum_of_squares(const float* x, int64_t n) {
  float lanes[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
#pragma omp simd
    for (int j = 0; j < 16; ++j) lanes[j] += x[i + j] * x[i + j];
  }
  for (; i < n; ++i) lanes[i % 16] += x[i] * x[i];
  float sum = 0.f;
  for (int j = 0; j < 16; ++j) sum += lanes[j];
  return sum;
}

__attribute__((noinline)) void rms_norm_row(float* o, const float* xr, const float* w, int64_t hidden, double eps) {
  const float squares = sum_of_squares(xr, hidden);
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) o[i] = xr[i] * inv * w[i];
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "rms_norm: float32 only");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.sizes() == out.sizes() && x.stride(-1) == 1 && out.stride(-1) == 1,
              "rms_norm: x and out of one shape, [T, D] or [T, H, D], with contiguous rows");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat, "rms_norm: weight");
  const int64_t heads = x.dim() == 3 ? x.size(1) : 1;
  const int64_t x_row = x.stride(0), o_row = out.stride(0);
  const int64_t x_head = x.dim() == 3 ? x.stride(1) : 0, o_head = out.dim() == 3 ? out.stride(1) : 0;
  const float* xs = x.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, x.size(0), grain(heads * hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) rms_norm_row(os + t * o_row + h * o_head, xs + t * x_row + h * x_head, w, hidden, eps);
  });
}

__attribute__((noinline)) void silu_and_mul_row(float* o, const float* gate, int64_t inner) {
  const float* up = gate + inner;
#pragma omp simd
  // e^-g capped at e^80: past e^88.7 it is infinite, which -ffast-math's reciprocal turns into NaN for a gate below
  // -88.7, where silu is 0 to float precision (as it still is with the cap).
  for (int64_t i = 0; i < inner; ++i) o[i] = gate[i] / (1.f + std::exp(std::min(-gate[i], 80.f))) * up[i];
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  check_float_rows(x, "silu_and_mul x");
  check_float_rows(out, "silu_and_mul out");
  const int64_t inner = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * inner && x.size(0) == out.size(0), "silu_and_mul: x must be [T, 2 * out width]");
  const float* xs = x.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t x_row = x.stride(0), o_row = out.stride(0);
  at::parallel_for(0, x.size(0), grain(2 * inner), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_and_mul_row(os + t * o_row, xs + t * x_row, inner);
  });
}

__attribute__((noinline)) void rotate_head(float* x1, const float* c, const float* s, int64_t half) {
  float* x2 = x1 + half;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = x1[i], b = x2[i];
    x1[i] = a * c[i] - b * s[i];
    x2[i] = b * c[i] + a * s[i];
  }
}

void rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1, "rotary_embedding: float32 [T, heads, D]");
  const int64_t tokens = x.size(0), half = x.size(2) / 2;
  TORCH_CHECK(num_heads >= 0 && num_heads <= x.size(1) && x.size(2) % 2 == 0, "rotary_embedding: heads");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == tokens * half && sin.numel() == tokens * half,
              "rotary_embedding: cos and sin must be contiguous float32 with T * D/2 values");
  float* xs = x.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* ss = sin.data_ptr<float>();
  const int64_t row = x.stride(0), head = x.stride(1);
  at::parallel_for(0, tokens, grain(num_heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < num_heads; ++h) rotate_head(xs + t * row + h * head, cs + t * half, ss + t * half, half);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmserve, m) {
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_embedding(Tensor(a!) x, Tensor cos, Tensor sin, int num_heads) -> ()");
}

TORCH_LIBRARY_IMPL(lmserve, CPU, m) {
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}
