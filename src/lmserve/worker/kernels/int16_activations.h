// What the int16-activation kernels share (int16_activations.cpp: q4_1, q8_0; kquant_int16.cpp: q4_k, q6_k): the
// activations split into two int8 halves per block of 32 inputs (int16_activations.cpp's top says how and why).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)) || \
    (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace lmserve_int16 {

constexpr int64_t kBlock = 32;  // inputs per block

struct Activations {
  std::vector<int8_t> high, low;               // [M][K]
  std::vector<float> scale, sum;               // [M][blocks]: s / 256, and the block's float32 sum of x
  std::vector<int32_t> high_sum, low_sum;      // [M][blocks]: 128 (sum of x_hi), 128 (sum of x_lo), for q8_0
  std::vector<int32_t> high_half, low_half;    // [M][2 blocks]: sums of x_hi and x_lo over each 16 inputs (q6_k)
};

// A layer's rows of llama.cpp blocks, given as parts that follow one another (a fused q/k/v's or gate/up's tensors),
// each uint8 [rows, blocks, bytes] and read where it lies (the loader's mapping of the file): the packers take them
// without a copy of the whole layer first.
struct BlockRows {
  std::vector<at::Tensor> parts;    // each contiguous
  std::vector<const uint8_t*> row;  // row r's first block
  int64_t blocks = 0;

  BlockRows(at::TensorList given, int64_t bytes, const char* name) {
    TORCH_CHECK(!given.empty(), name, " blocks: no rows given");
    for (const at::Tensor& part : given) {
      TORCH_CHECK(part.dim() == 3 && part.scalar_type() == at::kByte && part.size(2) == bytes &&
                      part.size(1) == given[0].size(1),
                  name, " blocks must be uint8 [N, K / block, ", bytes, "], every part as wide");
      parts.push_back(part.contiguous());
      const uint8_t* first = parts.back().data_ptr<uint8_t>();
      const int64_t row_bytes = part.size(1) * bytes;
      for (int64_t r = 0; r < part.size(0); ++r) row.push_back(first + r * row_bytes);
    }
    blocks = given[0].size(1);
  }
  int64_t size() const { return static_cast<int64_t>(row.size()); }
};

// One call of an int16 kernel's linear op: the input as contiguous [M, K] float32 rows, the bias (checked), the
// output [M, N] and the shape it is returned in (the input's, last dimension N).
struct LinearCall {
  at::Tensor x, y;
  std::vector<int64_t> out_shape;
  const float* bias = nullptr;
  int64_t M = 0, K = 0, N = 0;
};

inline LinearCall linear_call(const at::Tensor& input, int64_t out_features,
                              const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kFloat, "input must be float32 on CPU");
  LinearCall call;
  call.K = input.size(-1);
  call.N = out_features;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == call.N,
                "bias must be a contiguous float32 tensor of out_features");
    call.bias = bias->data_ptr<float>();
  }
  call.x = input.reshape({-1, call.K}).contiguous();
  call.M = call.x.size(0);
  call.out_shape.assign(input.sizes().begin(), input.sizes().end());
  call.out_shape.back() = call.N;
  call.y = at::empty({call.M, call.N}, call.x.options());
  return call;
}

inline void size_for(int64_t M, int64_t K, Activations& a) {
  const int64_t blocks = K / kBlock;
  a.high.resize(M * K);
  a.low.resize(M * K);
  a.scale.resize(M * blocks);
  a.sum.resize(M * blocks);
  a.high_sum.resize(M * blocks);
  a.low_sum.resize(M * blocks);
  a.high_half.resize(2 * M * blocks);
  a.low_half.resize(2 * M * blocks);
}

// split_rows without vector instructions, for builds without AVX-512 (the AVX2 build): the same arithmetic, element
// by element (the block's float sum in another order: bits may differ from an AVX-512 build's, never between two rows
// or two batches of one build), except that x_lo stops at -127: int16_simd.h's dot4_signed needs |x| <= 127.
inline void split_rows_portable(const float* x, int64_t M, int64_t K, Activations& a) {
  size_for(M, K, a);
  const int64_t blocks = K / kBlock;
  at::parallel_for(0, M * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * kBlock;
      float amax = 0.0f, sum = 0.0f;
      bool finite = true;
      for (int k = 0; k < kBlock; ++k) {
        // From the bits: -ffast-math lets the compiler assume no float compare ever sees an inf or NaN.
        finite = finite && (std::bit_cast<uint32_t>(src[k]) & 0x7F800000u) != 0x7F800000u;
        amax = std::max(amax, std::fabs(src[k]));
        sum += src[k];
      }
      a.sum[i] = sum;
      const float s = amax / 127.0f;
      const float inverse = finite && amax > 0 ? 127.0f / amax : 0.0f;
      a.scale[i] = std::bit_cast<float>(finite ? std::bit_cast<uint32_t>(s / 256.0f) : 0x7FC00000u);
      int32_t sums[2][2] = {{0, 0}, {0, 0}};  // [high, low][half]
      for (int k = 0; k < kBlock; ++k) {
        const float high = std::nearbyint(src[k] * inverse);
        const float rest = std::fma(-high, s, src[k]);
        const float low = std::min(std::max(std::nearbyint(rest * (inverse * 256.0f)), -127.0f), 127.0f);
        a.high[i * kBlock + k] = static_cast<int8_t>(high);
        a.low[i * kBlock + k] = static_cast<int8_t>(low);
        sums[0][k / 16] += static_cast<int32_t>(high);
        sums[1][k / 16] += static_cast<int32_t>(low);
      }
      for (int h = 0; h < 2; ++h) {
        a.high_half[2 * i + h] = sums[0][h];
        a.low_half[2 * i + h] = sums[1][h];
      }
      a.high_sum[i] = 128 * (sums[0][0] + sums[0][1]);
      a.low_sum[i] = 128 * (sums[1][0] + sums[1][1]);
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Reductions of one AVX2 register, for the AVX2 split below and kquant_int16.cpp's per-256 split (every build that
// has the int16 kernels has AVX2: the AVX-512 kinds too).
inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float max_lanes(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// 8 int32 lanes (each within int8) as 8 bytes at out.
inline void store_bytes(int8_t* out, __m256i v) {
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(words, words));
}

#endif  // AVX2 with FMA and F16C

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
// split_rows_portable in AVX2 vectors, for the AVX2 build: the same operations on each input (the halves' bits are
// the same), the block's float sum in another order. Element by element it took ~15% of a 512-row q4_k or q6_k
// product of 2,048 inputs by 2,048 outputs with 8-bit activations on one core of a shared 2-core Zen 3 (8.0 ms of a
// 16-output call, against 2.0 ms now): 1.08-1.18x the whole op at 64-512 rows.
inline void split_rows_avx2(const float* x, int64_t M, int64_t K, Activations& a) {
  size_for(M, K, a);
  const int64_t blocks = K / kBlock;
  at::parallel_for(0, M * blocks, 64, [&](int64_t begin, int64_t end) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i exponent = _mm256_set1_epi32(0x7F800000);
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * kBlock;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      __m256i infinite = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(src + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], magnitude));
        // From the bits: -ffast-math lets the compiler assume no float compare ever sees an inf or NaN.
        infinite = _mm256_or_si256(
            infinite, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v[j]), exponent), exponent));
      }
      const bool finite = _mm256_testz_si256(infinite, infinite);
      a.sum[i] = sum_lanes(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
      const float largest = max_lanes(amax);
      const float s = largest / 127.0f;
      const float inverse = finite && largest > 0 ? 127.0f / largest : 0.0f;
      a.scale[i] = std::bit_cast<float>(finite ? std::bit_cast<uint32_t>(s / 256.0f) : 0x7FC00000u);
      const __m256 vs = _mm256_set1_ps(s), vinv = _mm256_set1_ps(inverse), vinv256 = _mm256_set1_ps(inverse * 256.0f);
      __m256i sums[2][2];  // [high, low][half]
      for (int j = 0; j < 4; ++j) {
        const __m256 high = _mm256_round_ps(_mm256_mul_ps(v[j], vinv), kRound);
        const __m256 rest = _mm256_fnmadd_ps(high, vs, v[j]);
        const __m256 low = _mm256_min_ps(
            _mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(rest, vinv256), kRound), _mm256_set1_ps(-127.0f)),
            _mm256_set1_ps(127.0f));
        const __m256i high_int = _mm256_cvtps_epi32(high), low_int = _mm256_cvtps_epi32(low);
        store_bytes(a.high.data() + i * kBlock + 8 * j, high_int);
        store_bytes(a.low.data() + i * kBlock + 8 * j, low_int);
        if (j % 2 == 0) {
          sums[0][j / 2] = high_int;
          sums[1][j / 2] = low_int;
        } else {
          sums[0][j / 2] = _mm256_add_epi32(sums[0][j / 2], high_int);
          sums[1][j / 2] = _mm256_add_epi32(sums[1][j / 2], low_int);
        }
      }
      for (int h = 0; h < 2; ++h) {
        a.high_half[2 * i + h] = sum_lanes(sums[0][h]);
        a.low_half[2 * i + h] = sum_lanes(sums[1][h]);
      }
      a.high_sum[i] = 128 * (a.high_half[2 * i] + a.high_half[2 * i + 1]);
      a.low_sum[i] = 128 * (a.low_half[2 * i] + a.low_half[2 * i + 1]);
    }
  });
}
#endif  // AVX2 without AVX-512 VNNI

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
// Rows of x as two int8 halves per block (see the top). A block that holds an inf or NaN gets a NaN scale, so its
// outputs are NaN as a float product's would be. kHalves: also the sums over each 16 inputs (q6_k; four more
// reductions a block, ~2% of a 16-row decode step of the default model when always made).
template <bool kHalves = false>
inline void split_rows(const float* x, int64_t M, int64_t K, Activations& a) {
  const int64_t blocks = K / kBlock;
  size_for(M, K, a);
  at::parallel_for(0, M * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * kBlock;
      const __m512 v0 = _mm512_loadu_ps(src), v1 = _mm512_loadu_ps(src + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      a.sum[i] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
      // An inf or NaN is found from its bits: -ffast-math lets the compiler assume float compares never see one (and
      // MAXPS drops a NaN). Its block gets a NaN scale, built from bits too.
      const __m512i exponent = _mm512_set1_epi32(0x7F800000);
      const bool finite =
          !(_mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v0), exponent), exponent) |
            _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v1), exponent), exponent));
      const float s = amax / 127.0f;
      const float inverse = finite && amax > 0 ? 127.0f / amax : 0.0f;
      const uint32_t scale_bits = finite ? std::bit_cast<uint32_t>(s / 256.0f) : 0x7FC00000u;
      a.scale[i] = std::bit_cast<float>(scale_bits);
      const __m512 vs = _mm512_set1_ps(s), vinv = _mm512_set1_ps(inverse), vinv256 = _mm512_set1_ps(inverse * 256.0f);
      __m512i high_sum = _mm512_setzero_si512(), low_sum = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512 v = h ? v1 : v0;
        constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512i high = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v, vinv), kRound));
        const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(high), vs, v);
        const __m512i low = _mm512_cvtps_epi32(_mm512_min_ps(
            _mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(rest, vinv256), kRound), _mm512_set1_ps(-128.0f)),
            _mm512_set1_ps(127.0f)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a.high.data() + i * kBlock + 16 * h), _mm512_cvtsepi32_epi8(high));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a.low.data() + i * kBlock + 16 * h), _mm512_cvtsepi32_epi8(low));
        high_sum = _mm512_add_epi32(high_sum, high);
        low_sum = _mm512_add_epi32(low_sum, low);
        if constexpr (kHalves) {
          a.high_half[2 * i + h] = _mm512_reduce_add_epi32(high);
          a.low_half[2 * i + h] = _mm512_reduce_add_epi32(low);
        }
      }
      a.high_sum[i] = 128 * _mm512_reduce_add_epi32(high_sum);
      a.low_sum[i] = 128 * _mm512_reduce_add_epi32(low_sum);
    }
  });
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

#endif  // AVX-512 F, BW, VNNI and F16C

}  // namespace lmserve_int16
