// Linear layers over llama.cpp's block-quantized weights with float32 activations: y = x @ W.T (+ bias).
//
// Decoding a small model on a CPU reads every weight once per step, so bytes per weight set the speed. Two of
// GGUF's block formats, byte for byte as llama.cpp stores them (32 weights per block, row-major blocks):
//   q4_1: {fp16 d, fp16 m, 16 bytes}: w = d * q + m, q in 0..15; byte j holds weight j (low nibble) and j + 16.
//         20 bytes per 32 weights (0.625 bytes per weight).
//   q8_0: {fp16 d, 32 int8}: w = d * q. 34 bytes per 32 weights (1.0625 bytes per weight).
// The weights are widened to float32 in registers, a block at a time, and multiplied in float32: the activations are
// never quantized (llama.cpp quantizes them to 8 bits; this model's MLP inputs carry outliers that int8 activations
// ruin, docs/benchmarks.md).
//
// Work is split over output rows on torch's OpenMP threads.
#include <torch/extension.h>

#include <ATen/Parallel.h>

// AVX2 with FMA and F16C only; elsewhere the ops are not registered and lmserve keeps float16 weights.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// decode(block, scale, w): the block's 32 weights as four vectors of 8 floats, in order. The row's scales (and
// minimums) are widened to float32 beforehand (widen_scales), so that each block broadcasts them from memory rather
// than spending shuffle slots on them.
struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static constexpr int kScales = 2;  // d, m
  static inline void decode(const uint8_t* block, const float* scale, __m256 w[4]) {
    const __m256 d = _mm256_broadcast_ss(scale), m = _mm256_broadcast_ss(scale + 1);
    // Each byte widened to 32 bits once; its low nibble is weight j, its high nibble weight j + 16.
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 4)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 12)));
    const __m256i low = _mm256_set1_epi32(0x0F);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, low)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, low)), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), d, m);
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static constexpr int kScales = 1;  // d
  static inline void decode(const uint8_t* block, const float* scale, __m256 w[4]) {
    const __m256 d = _mm256_broadcast_ss(scale);
    for (int i = 0; i < 4; ++i) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), d);
    }
  }
};

// The float16 scale (and minimum) at the start of each of a row's blocks, as float32: [blocks][kScales].
template <class Format>
inline void widen_scales(const uint8_t* row, int64_t blocks, float* scales) {
  for (int64_t b = 0; b < blocks; ++b)
    for (int i = 0; i < Format::kScales; ++i) scales[b * Format::kScales + i] = half_to_float(row + b * Format::kBytes + 2 * i);
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Input rows are copied once per call into tiles of up to 8 rows laid out block by block ([block][row][32]), so the
// inner loop reads all of a tile's inputs from one pointer and a tile stays in L1 while the weight rows pass over it.
struct Tile {
  int64_t first_row, rows;
  const float* data;
};

inline int tile_rows(int64_t remaining) { return remaining >= 8 ? 8 : remaining >= 4 ? 4 : remaining >= 2 ? 2 : 1; }

std::vector<Tile> pack_tiles(const float* x, int64_t M, int64_t K, float* packed) {
  std::vector<Tile> tiles;
  const int64_t blocks = K / kBlock;
  for (int64_t t0 = 0; t0 < M;) {
    const int rows = tile_rows(M - t0);
    for (int64_t b = 0; b < blocks; ++b)
      for (int t = 0; t < rows; ++t)
        std::memcpy(packed + (b * rows + t) * kBlock, x + (t0 + t) * K + b * kBlock, kBlock * sizeof(float));
    tiles.push_back({t0, rows, packed});
    packed += rows * K;
    t0 += rows;
  }
  return tiles;
}

// One output row against a tile of T input rows, with T * S independent accumulators so that the FMAs' latency is
// hidden even when T is small (each takes one of the block's four weight vectors in turn).
template <class Format, int T>
inline void row_tile(const float* tile, int64_t blocks, const uint8_t* row, const float* scales, float* out,
                     int64_t out_stride) {
  constexpr int S = T >= 8 ? 1 : (T >= 4 ? 2 : 4);
  __m256 acc[T][S];
  for (int t = 0; t < T; ++t)
    for (int s = 0; s < S; ++s) acc[t][s] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, tile += T * kBlock) {
    __m256 w[4];
    Format::decode(row + b * Format::kBytes, scales + b * Format::kScales, w);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < 4; ++j)
        acc[t][j % S] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(tile + t * kBlock + 8 * j), acc[t][j % S]);
  }
  for (int t = 0; t < T; ++t) {
    __m256 sum = acc[t][0];
    for (int s = 1; s < S; ++s) sum = _mm256_add_ps(sum, acc[t][s]);
    out[t * out_stride] = horizontal_sum(sum);
  }
}

// Output rows [row_begin, row_end) for every tile of inputs.
template <class Format>
void rows_product(const std::vector<Tile>& tiles, int64_t K, const uint8_t* weight, int64_t row_begin,
                  int64_t row_end, const float* bias, float* y, int64_t N) {
  const int64_t blocks = K / kBlock;
  const int64_t row_bytes = blocks * Format::kBytes;
  std::vector<float> scales(blocks * Format::kScales);
  for (const Tile& tile : tiles) {
    float* out = y + tile.first_row * N;
    for (int64_t n = row_begin; n < row_end; ++n) {
      const uint8_t* row = weight + n * row_bytes;
      widen_scales<Format>(row, blocks, scales.data());
      const float* s = scales.data();
      switch (tile.rows) {
        case 8: row_tile<Format, 8>(tile.data, blocks, row, s, out + n, N); break;
        case 4: row_tile<Format, 4>(tile.data, blocks, row, s, out + n, N); break;
        case 2: row_tile<Format, 2>(tile.data, blocks, row, s, out + n, N); break;
        default: row_tile<Format, 1>(tile.data, blocks, row, s, out + n, N);
      }
      if (bias)
        for (int64_t t = 0; t < tile.rows; ++t) out[t * N + n] += bias[n];
    }
  }
}

void check_inputs(const torch::Tensor& weight, int64_t N, int64_t K, int64_t block_bytes) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == torch::kUInt8 && weight.is_contiguous(),
              "packed weight must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(K > 0 && K % kBlock == 0, "in_features must be a positive multiple of 32, got ", K);
  TORCH_CHECK(weight.numel() == N * (K / kBlock) * block_bytes, "packed weight has ", weight.numel(),
              " bytes, expected ", N * (K / kBlock) * block_bytes, " for ", N, " x ", K);
}

template <class Format>
torch::Tensor linear(const torch::Tensor& input, const torch::Tensor& weight, int64_t out_features,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == torch::kFloat32, "input must be float32 on CPU");
  const int64_t K = input.size(-1);
  const int64_t N = out_features;
  check_inputs(weight, N, K, Format::kBytes);
  const torch::Tensor x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  const float* bias_data = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous float32 tensor of out_features");
    bias_data = bias->data_ptr<float>();
  }
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = N;
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0) return y.view(out_shape);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // torch's allocator aligns to 64 bytes, so no 32-byte load of a tile straddles two cache lines.
  torch::Tensor packed = torch::empty({M * K}, x.options());
  const std::vector<Tile> tiles = pack_tiles(xp, M, K, packed.data_ptr<float>());
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    rows_product<Format>(tiles, K, wp, begin, end, bias_data, yp, N);
  });
  return y.view(out_shape);
}

// The float32 weight matrix [N, K] into out, for products with many input rows, where a float32 GEMM beats
// widening each block once per pair of rows.
template <class Format>
void dequantize(const torch::Tensor& weight, torch::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.dim() == 2, "out must be [N, K] float32");
  const int64_t N = out.size(0), K = out.size(1);
  check_inputs(weight, N, K, Format::kBytes);
  const int64_t blocks = K / kBlock;
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N * blocks, 256, [&](int64_t begin, int64_t end) {
    float scales[Format::kScales];
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* block = wp + i * Format::kBytes;
      widen_scales<Format>(block, 1, scales);
      __m256 w[4];
      Format::decode(block, scales, w);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(op + i * kBlock + 8 * j, w[j]);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmserve, m) {
  m.def("q4_1_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q8_0_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q4_1_dequantize(Tensor weight, Tensor(a!) out) -> ()");
  m.def("q8_0_dequantize(Tensor weight, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(lmserve, CPU, m) {
  m.impl("q4_1_linear", &linear<Q4_1>);
  m.impl("q8_0_linear", &linear<Q8_0>);
  m.impl("q4_1_dequantize", [](const torch::Tensor& w, torch::Tensor out) { dequantize<Q4_1>(w, out); });
  m.impl("q8_0_dequantize", [](const torch::Tensor& w, torch::Tensor out) { dequantize<Q8_0>(w, out); });
}

#endif  // AVX2, FMA, F16C
