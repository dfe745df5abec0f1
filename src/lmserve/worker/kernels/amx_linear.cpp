// y = bfloat16(x) @ W.T (+ bias) on Intel AMX tiles: float32 activations rounded to bfloat16 as they are read, a
// bfloat16 copy of the weights, products summed in float32 by TDPBF16PS and float32 out.
//
// Why not oneDNN (torch's bfloat16 linear): it picks a different kernel, and so a different order of summation, for
// different numbers of rows, so one row's result depends on how many rows share the call (about 1 output in 10,000
// moves by one bfloat16 step between a call of 9 rows and one of 600). Here every output is one chain of tile
// products over K in the same order for every row, whatever the batch: a prompt token's activations are the same
// alone, in a batch of 16 or split into other chunks. Measured on a 2-core Sapphire Rapids VM it also beats oneDNN's
// bfloat16 path at prefill sizes (it writes float32 directly, where torch's rounds to bfloat16 and widens again).
//
// Weights: [N / 16][K / 32] tiles of 16 rows of 64 bytes, AMX's "VNNI" layout for B: tile row kk holds, for each of
// 16 output columns n, the pair W[n][2kk], W[n][2kk + 1] (amx_pack_weight lays them out).
// Register use: four accumulator tiles (32 rows x 32 outputs), two tiles of activations, two of weights.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kTileRows = 16;       // rows of a tile
constexpr int64_t kTileK = 32;          // bfloat16 values in a tile row (64 bytes)
constexpr int64_t kRowsPerPass = 32;    // two tiles of activations
constexpr int64_t kColsPerPass = 32;    // two tiles of weights
constexpr int64_t kRowsPerChunk = 128;  // activations re-used from L2 across one thread's columns

// Linux gives a process the AMX register state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM); without it the
// first tile instruction faults. Asked once; the answer holds for every thread of the process.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: accumulators (16 x 16 float32); 4-5: activations (16 rows x 32 bfloat16); 6-7: weights (16 pairs-rows
// x 16 columns x 2).
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Rows [m0, m0 + count) of x (float32, row stride K) as bfloat16 (round to nearest even, as torch's .to(bfloat16)) into
// out, [count_padded, K]; rows from M on are zeros.
void round_rows(const float* x, int64_t m0, int64_t count_padded, int64_t M, int64_t K, uint16_t* out) {
  for (int64_t r = 0; r < count_padded; ++r) {
    uint16_t* dst = out + r * K;
    if (m0 + r >= M) {
      std::memset(dst, 0, K * sizeof(uint16_t));
      continue;
    }
    const float* src = x + (m0 + r) * K;
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
      _mm512_storeu_si512(dst + k, (__m512i)pair);
    }
  }
}

// Output columns [n0, n0 + 32) of rows [m0, m0 + 32): the four accumulators over all of K.
inline void tile_pass(const uint16_t* a, const uint16_t* w, int64_t K, int64_t m0, int64_t nb0, int64_t M, int64_t N,
                      const float* bias, float* y) {
  const int64_t k_tiles = K / kTileK;
  const uint16_t* a0 = a + m0 * K;
  const uint16_t* a1 = a0 + kTileRows * K;
  const uint16_t* w0 = w + nb0 * k_tiles * kTileRows * kTileK;
  const uint16_t* w1 = w0 + k_tiles * kTileRows * kTileK;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    _tile_loadd(4, a0 + kt * kTileK, K * 2);
    _tile_loadd(5, a1 + kt * kTileK, K * 2);
    _tile_loadd(6, w0 + kt * kTileRows * kTileK, 64);
    _tile_loadd(7, w1 + kt * kTileRows * kTileK, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float out[kRowsPerPass][kColsPerPass];
  _tile_stored(0, &out[0][0], kColsPerPass * 4);
  _tile_stored(1, &out[0][16], kColsPerPass * 4);
  _tile_stored(2, &out[16][0], kColsPerPass * 4);
  _tile_stored(3, &out[16][16], kColsPerPass * 4);
  const int64_t n0 = nb0 * kTileRows;
  const __m512 b0 = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + n0 + 16) : _mm512_setzero_ps();
  const int64_t rows = std::min(kRowsPerPass, M - m0);
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = y + (m0 + r) * N + n0;
    _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_load_ps(out[r]), b0));
    _mm512_storeu_ps(dst + 16, _mm512_add_ps(_mm512_load_ps(out[r] + 16), b1));
  }
}

at::Tensor amx_linear(const at::Tensor& input, const at::Tensor& weight, int64_t out_features,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_permitted(), "the kernel did not grant this process the AMX tile state (arch_prctl)");
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kFloat, "input must be float32 on CPU");
  const int64_t K = input.size(-1), N = out_features;
  TORCH_CHECK(K > 0 && K % kTileK == 0, "in_features must be a positive multiple of 32, got ", K);
  TORCH_CHECK(N > 0 && N % kColsPerPass == 0, "out_features must be a positive multiple of 32, got ", N);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == N * K,
              "weight must be amx_pack_weight's contiguous bfloat16 tiles of an [", N, ", ", K, "] matrix");
  const float* bias_data = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous float32 tensor of out_features");
    bias_data = bias->data_ptr<float>();
  }
  const at::Tensor x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.view(out_shape);
  const int64_t M_padded = (M + kRowsPerPass - 1) / kRowsPerPass * kRowsPerPass;
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / kColsPerPass, 1, [&](int64_t begin, int64_t end) {
    // Each thread rounds the chunk of rows it is about to use into its own buffer, which stays in its L2: no pass of
    // all rows through memory before the products, and no buffer of all of them.
    std::vector<uint16_t> rounded(kRowsPerChunk * K + 32);
    // 64-byte aligned (32 bfloat16), so that no tile row straddles two cache lines.
    uint16_t* chunk = rounded.data() + (32 - reinterpret_cast<uintptr_t>(rounded.data()) % 64 / 2) % 32;
    configure_tiles();
    for (int64_t c0 = 0; c0 < M_padded; c0 += kRowsPerChunk) {
      const int64_t rows = std::min(M_padded, c0 + kRowsPerChunk) - c0;
      round_rows(xp, c0, rows, M, K, chunk);
      for (int64_t pair = begin; pair < end; ++pair)
        for (int64_t m0 = 0; m0 < rows; m0 += kRowsPerPass)
          tile_pass(chunk, w, K, m0, pair * 2, M - c0, N, bias_data, yp + c0 * N);
    }
    _tile_release();
  });
  return y.view(out_shape);
}

// [N, K] weights (any float type) as bfloat16 tiles in amx_linear's layout.
at::Tensor amx_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [out_features, in_features]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kColsPerPass == 0 && K % kTileK == 0, "weight must be a multiple of 32 in both dimensions");
  return weight.to(at::kBFloat16)
      .reshape({N / kTileRows, kTileRows, K / kTileK, kTileK / 2, 2})
      .permute({0, 2, 3, 1, 4})
      .contiguous()
      .reshape({N, K});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmserve, m) {
  m.def("amx_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("amx_pack_weight(Tensor weight) -> Tensor");
  m.def("amx_available() -> bool", [] { return amx_permitted(); });
}

TORCH_LIBRARY_IMPL(lmserve, CPU, m) {
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_pack_weight", &amx_pack_weight);
}

#endif  // AMX-TILE, AMX-BF16, AVX512-BF16, Linux
