// Linear layers over llama.cpp's K-quant weights (q2_k, q3_k, q4_k, q5_k, q6_k), with the activations as 16-bit
// integers per block of 32 inputs: y = x @ W.T (+ bias). What Q4_K_M and Q6_K files store, read at their stored size.
// Built for AVX-512 VNNI (VPDPBUSD) or for AVX2 (the same products as VPMADDUBSW + VPMADDWD), from one source over a
// few primitives.
//
// K-quants group a row's weights in super-blocks of 256 with a float16 scale d (q4_k: and minimum scale dmin), and
// sub-blocks with small integer scales:
//   q4_k: 8 sub-blocks of 32, 6-bit scale sc and minimum mn, 4-bit q:  w = (d sc) q - (dmin mn)   (4.5 bits a weight)
//   q5_k: the same with 5-bit q                                                                       (5.5 bits)
//   q6_k: 16 sub-blocks of 16, int8 scale sc, 6-bit q:                  w = (d sc) (q - 32)        (6.5625 bits)
//   q3_k: the same with 3-bit q (the file's 6-bit ls, as sc = ls - 32):   w = (d sc) (q - 4)         (3.4375 bits)
//   q2_k: 16 sub-blocks of 16, 4-bit scale sc and minimum mn, 2-bit q:  w = (d sc) q - (dmin mn)   (2.625 bits)
// d sc and dmin mn are exact in float32 (11-bit by 8-bit products), so each sub-block is a q4_1 / q8_0 block with
// float32 scales, and int16_activations.cpp's exact integer dot products apply per block of 32 inputs (q6_k, q3_k,
// q2_k: per half block, each half with its scale; q2_k's minimum against the half's sum of the integer activations).
// Every row is computed alone, in the same order whatever shares its call.
//
// Layout (worker/weights/kquants.py packs it from the file's blocks, byte for byte of what they hold), per group of 16
// output rows and super-block of 256 inputs: a header of the 16 rows' d (float16; q4_k: then their dmin), then per
// block of 32 inputs, as int16_activations.cpp's: the 16 rows' sub-block scales (q4_k: 16 sc, 16 mn as bytes; q6_k:
// 16 int8 sc of the first 16 inputs, 16 of the second), the low 4 bits of q as 4 chunks of 64 bytes (chunk c: row 2c
// in the low nibbles, 2c + 1 in the high ones; row j holds q[n][4j..4j+3] for n = 0..15), and (q6_k) the top 2 bits
// as 2 chunks of 64 (chunk h: row 4h + r in bits 2r, 2r + 1). q3_k: q6_k's scales, then the low 2 bits of q as q6_k's
// top bits, then the third bit as q5_k's fifth (bit j of byte 4n + e: row j's).
//   q4_k: 64 + 8 x (32 + 256) = 2,368 bytes per 16 x 256 weights (the file's 144 per 256: 4.5 bits + 0.125)
//   q6_k: 32 + 8 x (32 + 384) = 3,360 bytes (the file's 210 per 256: 6.5625 bits)
//   q3_k: 32 + 8 x (32 + 192) = 1,824 bytes (the file's 110 per 256: 3.4375 bits + 0.125)
//   q2_k: 64 + 8 x (64 + 128) = 1,600 bytes (the file's 84 per 256: 2.625 bits + 0.5): the header's 16 d and 16 dmin,
//         per block the halves' 16 + 16 sc and 16 + 16 mn as bytes, the 2-bit q as q3_k's low bits
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "int16_simd.h"

#if defined(LMSERVE_INT16_KERNELS)

namespace {

using namespace lmserve_int16;

constexpr int64_t kSuper = 256;
constexpr int64_t kBlocksPerSuper = kSuper / kBlock;

struct Q4_K {
  static constexpr const char* kName = "q4_k";
  static constexpr int64_t kHeader = 64;           // 16 d, 16 dmin
  static constexpr int64_t kBlockBytes = 32 + 256;  // 16 sc, 16 mn, nibbles
  static constexpr int kTileRows = kAvx512 ? 6 : 2;
  static constexpr int kTileRows8 = kAvx512 ? 8 : 4;  // 8-bit activations: half the accumulators a row
  static constexpr int kPerWiden = 8;  // int16_simd.h's dot_rows on AVX2: codes <= 15
  static inline void quants(const uint8_t* block, U8 rows[8]) { low_nibbles(block + 32, rows); }
  // q of output n at input k of a block (for dequantize).
  static inline int quant(const uint8_t* block, int n, int k) {
    const int j = k / 4, e = k % 4;
    const uint8_t byte = block[32 + 64 * (j / 2) + 4 * n + e];
    return j % 2 ? byte >> 4 : byte & 0x0F;
  }
};

// q5_k: q4_k with a fifth bit per code (q in 0..31), as one more chunk of 64 bytes per block (int16_simd.h's
// fifth_bits): 64 + 8 x (32 + 256 + 64) = 2,880 bytes per 16 x 256 weights (the file's 176 per 256: 5.5 bits + 0.125).
struct Q5_K {
  static constexpr const char* kName = "q5_k";
  static constexpr int64_t kHeader = 64;                 // 16 d, 16 dmin
  static constexpr int64_t kBlockBytes = 32 + 256 + 64;  // 16 sc, 16 mn, nibbles, fifth bits
  static constexpr int kTileRows = kAvx512 ? 6 : 2;
  static constexpr int kTileRows8 = kAvx512 ? 8 : 4;
  static constexpr int kPerWiden = 4;  // codes <= 31
  static inline void quants(const uint8_t* block, U8 rows[8]) {
    low_nibbles(block + 32, rows);
    fifth_bits(block + 32 + 256, rows);
  }
  static inline int quant(const uint8_t* block, int n, int k) {
    const int j = k / 4, e = k % 4;
    return Q4_K::quant(block, n, k) | (((block[32 + 256 + 4 * n + e] >> j) & 1) << 4);
  }
};

struct Q6_K {
  static constexpr const char* kName = "q6_k";
  static constexpr int kOffset = 32;  // w = (d sc) (q - 32)
  static constexpr int64_t kHeader = 32;                  // 16 d
  static constexpr int64_t kBlockBytes = 32 + 256 + 128;  // 16 + 16 sc, nibbles, top bits
  static constexpr int kTileRows = kAvx512 ? 4 : 1;      // four accumulators a row
  static constexpr int kTileRows8 = kAvx512 ? 6 : 2;
  static constexpr int kPerWiden = 2;                     // codes <= 63
  static inline void quants(const uint8_t* block, U8 rows[8]) {
    low_nibbles(block + 32, rows);
    for (int h = 0; h < 2; ++h) {
      const U8 v = load64(block + 32 + 256 + 64 * h);
      // Row 4h + r's two bits sit at 2r: moved to bits 4-5 of each byte (16-bit shifts; what crosses bytes is masked).
      rows[4 * h] = or8(rows[4 * h], and8(shift_left16<4>(v), 0x30));
      rows[4 * h + 1] = or8(rows[4 * h + 1], and8(shift_left16<2>(v), 0x30));
      rows[4 * h + 2] = or8(rows[4 * h + 2], and8(v, 0x30));
      rows[4 * h + 3] = or8(rows[4 * h + 3], and8(shift_right16<2>(v), 0x30));
    }
  }
  static inline int quant(const uint8_t* block, int n, int k) {
    const int j = k / 4, e = k % 4;
    const uint8_t low = block[32 + 64 * (j / 2) + 4 * n + e];
    const uint8_t top = block[32 + 256 + 64 * (j / 4) + 4 * n + e];
    return ((j % 2 ? low >> 4 : low & 0x0F) | (((top >> (2 * (j % 4))) & 3) << 4));
  }
};

// Two chunks of 64 bytes of 2-bit codes (chunk h: row 4h + r at bits 2r) as rows 0-7 (q3_k's and q2_k's low bits).
inline void two_bit_rows(const uint8_t* chunks, U8 rows[8]) {
  for (int h = 0; h < 2; ++h) {
    const U8 v = load64(chunks + 64 * h);
    rows[4 * h] = and8(v, 0x03);
    rows[4 * h + 1] = and8(shift_right16<2>(v), 0x03);
    rows[4 * h + 2] = and8(shift_right16<4>(v), 0x03);
    rows[4 * h + 3] = and8(shift_right16<6>(v), 0x03);
  }
}

inline int two_bit_code(const uint8_t* chunks, int n, int k) {
  const int j = k / 4, e = k % 4;
  return (chunks[64 * (j / 4) + 4 * n + e] >> (2 * (j % 4))) & 3;
}

struct Q3_K {
  static constexpr const char* kName = "q3_k";
  static constexpr int kOffset = 4;                     // w = (d sc) (q - 4)
  static constexpr int64_t kHeader = 32;                // 16 d
  static constexpr int64_t kBlockBytes = 32 + 128 + 64;  // 16 + 16 sc, low 2 bits, third bits
  static constexpr int kTileRows = kAvx512 ? 4 : 1;     // four accumulators a row, as q6_k
  static constexpr int kTileRows8 = kAvx512 ? 6 : 2;
  static constexpr int kPerWiden = 4;                    // codes <= 7: 4 x 2 x 7 x 127 < 2^15 (4 rows a half)
  static inline void quants(const uint8_t* block, U8 rows[8]) {
    two_bit_rows(block + 32, rows);
    bit_plane<2>(block + 32 + 128, rows);  // row j's third bit, at bit j of each byte
  }
  static inline int quant(const uint8_t* block, int n, int k) {
    const int third = (block[32 + 128 + 4 * n + k % 4] >> (k / 4)) & 1;
    return two_bit_code(block + 32, n, k) | (third << 2);
  }
};

struct Q2_K {
  static constexpr const char* kName = "q2_k";
  static constexpr int64_t kHeader = 64;           // 16 d, 16 dmin
  static constexpr int64_t kBlockBytes = 64 + 128;  // 16 + 16 sc, 16 + 16 mn, 2-bit codes
  static constexpr int kTileRows = kAvx512 ? 4 : 1;
  static constexpr int kTileRows8 = kAvx512 ? 6 : 2;
  static constexpr int kPerWiden = 4;  // codes <= 3 (4 rows a half)
  static inline void quants(const uint8_t* block, U8 rows[8]) { two_bit_rows(block + 64, rows); }
  static inline int quant(const uint8_t* block, int n, int k) { return two_bit_code(block + 64, n, k); }
};

// Sub-blocks of 16 (q6_k, q3_k, q2_k): each half of a block of 32 inputs has its scale.
template <class Format>
constexpr bool kHalfBlocks =
    std::is_same_v<Format, Q6_K> || std::is_same_v<Format, Q3_K> || std::is_same_v<Format, Q2_K>;

template <class Format>
constexpr int64_t super_bytes() { return Format::kHeader + kBlocksPerSuper * Format::kBlockBytes; }

// T input rows (from row `row`) against one group of 16 outputs, all blocks. kLow: both activation halves; without
// it the high halves alone, 8-bit activations (int16_activations.cpp's group_product says why).
template <class Format, int T, bool kLow = true>
void group_product(const uint8_t* group, int64_t blocks, const Activations& a, int64_t row, int64_t K,
                   const float* bias, float* y, int64_t N, int64_t n0) {
  constexpr bool kSixBit = kHalfBlocks<Format>;
  F32 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = zero_f();
  const int8_t* high = a.high.data() + row * K;
  const int8_t* low = a.low.data() + row * K;
  const int64_t first = row * blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* super = group + b / kBlocksPerSuper * super_bytes<Format>();
    const uint8_t* block = super + Format::kHeader + b % kBlocksPerSuper * Format::kBlockBytes;
    prefetch_block(block, Format::kBlockBytes);
    U8 rows[8];
    Format::quants(block, rows);
    // Per row: dot products with the high and low activation halves (q6_k: of each 16-input half apart).
    constexpr int kHalves = kSixBit ? 2 : 1;
    I32 dot_high[T][kHalves], dot_low[T][kHalves];
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < kHalves; ++h) dot_high[t][h] = dot_low[t][h] = zero_i();
    if constexpr (kAvx512) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
        for (int t = 0; t < T; ++t) {
          const int h = kSixBit ? j / 4 : 0;
          const int64_t at = t * K + b * kBlock + 4 * j;
          dot_high[t][h] = dot4(dot_high[t][h], rows[j], high + at);
          if constexpr (kLow) dot_low[t][h] = dot4(dot_low[t][h], rows[j], low + at);
        }
    } else {
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < kHalves; ++h) {
          const int64_t at = t * K + b * kBlock + 16 * h;
          dot_high[t][h] = dot_rows<Format::kPerWiden>(dot_high[t][h], rows + 4 * h, 8 / kHalves, high + at);
          if constexpr (kLow)
            dot_low[t][h] = dot_rows<Format::kPerWiden>(dot_low[t][h], rows + 4 * h, 8 / kHalves, low + at);
        }
    }
    const F32 d = widen16(super);
    if constexpr (std::is_same_v<Format, Q2_K>) {
      const F32 dmin = widen16(super + 32);
      const F32 scales[2] = {mul(d, bytes_unsigned(block)), mul(d, bytes_unsigned(block + 16))};
      const F32 minimums[2] = {mul(dmin, bytes_unsigned(block + 32)), mul(dmin, bytes_unsigned(block + 48))};
      for (int t = 0; t < T; ++t) {
        const int64_t i = first + t * blocks + b;
        const F32 s = set1(a.scale[i]);
        for (int h = 0; h < 2; ++h) {
          // (d sc) (q . x) - (dmin mn) (sum of x), x the half's integer activations (x_hi alone with 8-bit ones).
          const F32 dh = to_float(dot_high[t][h]), dl = kLow ? to_float(dot_low[t][h]) : zero_f();
          const float half_sum = 256.0f * static_cast<float>(a.high_half[2 * i + h]) +
                                 (kLow ? static_cast<float>(a.low_half[2 * i + h]) : 0.0f);
          acc[t] = fmadd(fmadd(dh, set1(256.0f), dl), mul(scales[h], s), acc[t]);
          acc[t] = fnmadd(mul(minimums[h], s), set1(half_sum), acc[t]);
        }
      }
    } else if constexpr (kSixBit) {
      const F32 scale0 = mul(d, bytes_signed(block)), scale1 = mul(d, bytes_signed(block + 16));
      for (int t = 0; t < T; ++t) {
        const int64_t i = first + t * blocks + b;
        const F32 s = set1(a.scale[i]);
        for (int h = 0; h < 2; ++h) {
          // q - offset: offset x (sum of the half's activations) off each exact dot product.
          const F32 dh = to_float(sub_i(dot_high[t][h], Format::kOffset * a.high_half[2 * i + h]));
          const F32 dl = kLow ? to_float(sub_i(dot_low[t][h], Format::kOffset * a.low_half[2 * i + h])) : zero_f();
          acc[t] = fmadd(fmadd(dh, set1(256.0f), dl), mul(h ? scale1 : scale0, s), acc[t]);
        }
      }
    } else {
      const F32 scale = mul(d, bytes_unsigned(block));
      const F32 minimum = mul(widen16(super + 32), bytes_unsigned(block + 16));
      for (int t = 0; t < T; ++t) {
        const int64_t i = first + t * blocks + b;
        // q4_k: 256 (q . x_hi) + (q . x_lo) < 2^24 (q <= 15), exact in float32. q5_k's (q <= 31) can pass 2^24: one
        // FMA of the two exact dot products.
        const F32 dot = std::is_same_v<Format, Q4_K>
                            ? to_float(add_i(shift_left32_8(dot_high[t][0]), dot_low[t][0]))
                            : fmadd(to_float(dot_high[t][0]), set1(256.0f), to_float(dot_low[t][0]));
        acc[t] = fmadd(dot, mul(scale, set1(a.scale[i])), acc[t]);
        acc[t] = fnmadd(minimum, set1(a.sum[i]), acc[t]);
      }
    }
  }
  const F32 bv = bias ? loadu(bias + n0) : zero_f();
  for (int t = 0; t < T; ++t) storeu(y + (row + t) * N + n0, add(acc[t], bv));
}

// 8-bit activations with one scale per super-block of 256 inputs (llama.cpp's q8_K), for q4_k, q5_k and q6_k: the
// sub-block scales sc (and q4_k's, q5_k's minimums mn) multiply the integer dot products in int32 (on AVX2 as
// VPMADDWD's multiplier, where dot_rows widens with ones), so a row pays one float step per 256 inputs instead of
// one per 32 (with one scale per 32, the float step was most of a prompt product: a register-blocked integer core
// alone ran at 70-95 G multiply-adds/s against the product's 25-40). Each row is quantized and summed alone, so a
// row's bits stay its own whatever shares its call. The activations are coarser than one scale per 32 (the same ones
// llama.cpp multiplies these files with); set_kquant_super_scale(false) (LMSERVE_DISABLE_CPU_FEATURES=q8k) runs the
// per-32 products instead.
//   q4_k, q5_k: y = sum over super-blocks of (d s) (sum_b sc_b (q_b . x_b)) - (dmin s) (sum_b mn_b (sum of x_b))
//   q6_k:       y = sum over super-blocks of (d s) (sum_h sc_h (q_h . x_h) - 32 sum_h sc_h (sum of x_h))
// x the integer activations, s their scale; all sums in int32 (q4_k: below 2^25, q6_k below 2^29).
std::atomic<bool> kquant_super_scale{true};

template <class Format>
constexpr bool kSuperScaled = std::is_same_v<Format, Q4_K> || std::is_same_v<Format, Q5_K> ||
                              std::is_same_v<Format, Q6_K>;

struct SuperActivations {
  std::vector<int8_t> q;       // [M][K]: round(x / s), |q| <= 127
  std::vector<float> scale;    // [M][K / 256]: s = (largest |x|) / 127; NaN where the super-block holds an inf or NaN
  std::vector<int16_t> sum16;  // [M][K / 16]: sums of q over each 16 inputs (q6_k's sub-blocks)
  std::vector<int16_t> sum32;  // [M][K / 32]: over each 32 (q4_k's, q5_k's)
};

// Rows of x (K a multiple of 256) as SuperActivations, in AVX2 vectors (every kind that builds these kernels has them).
inline void split_super_rows(const float* x, int64_t M, int64_t K, SuperActivations& a) {
  const int64_t supers = K / kSuper;
  a.q.resize(M * K);
  a.scale.resize(M * supers);
  a.sum16.resize(M * K / 16);
  a.sum32.resize(M * K / kBlock);
  at::parallel_for(0, M * supers, 8, [&](int64_t begin, int64_t end) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i exponent = _mm256_set1_epi32(0x7F800000);
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t i = begin; i < end; ++i) {  // i: row i / supers, super-block i % supers
      const float* src = x + i * kSuper;
      __m256 amax = _mm256_setzero_ps();
      __m256i infinite = _mm256_setzero_si256();
      for (int j = 0; j < kSuper / 8; ++j) {
        const __m256 v = _mm256_loadu_ps(src + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v, magnitude));
        // From the bits: -ffast-math lets the compiler assume no float compare ever sees an inf or NaN.
        infinite = _mm256_or_si256(
            infinite, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent), exponent));
      }
      const bool finite = _mm256_testz_si256(infinite, infinite);
      const float largest = max_lanes(amax);
      a.scale[i] = std::bit_cast<float>(finite ? std::bit_cast<uint32_t>(largest / 127.0f) : 0x7FC00000u);
      const __m256 inverse = _mm256_set1_ps(finite && largest > 0 ? 127.0f / largest : 0.0f);
      int8_t* q = a.q.data() + i * kSuper;
      int16_t* sum16 = a.sum16.data() + i * (kSuper / 16);
      for (int g = 0; g < kSuper / 16; ++g) {
        const __m256i first = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(src + 16 * g), inverse), kRound));
        const __m256i second =
            _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(src + 16 * g + 8), inverse), kRound));
        store_bytes(q + 16 * g, first);
        store_bytes(q + 16 * g + 8, second);
        sum16[g] = static_cast<int16_t>(sum_lanes(_mm256_add_epi32(first, second)));
      }
      for (int b = 0; b < kBlocksPerSuper; ++b)
        a.sum32[i * kBlocksPerSuper + b] = static_cast<int16_t>(sum16[2 * b] + sum16[2 * b + 1]);
    }
  });
}

inline int32_t two_sums(const int16_t* p) {  // p[0] in the low 16 bits, p[1] in the high: madd_pairs' packed
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(LMSERVE_INT16_KERNELS_AVX2)
// Row J of a block's codes (inputs 4J .. 4J + 3 of each output), decoded alone: Format::quants' rows[J].
template <class Format, int J>
inline U8 quant_row(const uint8_t* block) {
  const U8 v = load64(block + 32 + 64 * (J / 2));
  U8 row = and8(J % 2 ? shift_right16<4>(v) : v, 0x0F);
  if constexpr (std::is_same_v<Format, Q5_K>)
    row = or8(row, and8(shift16<4 - J>(load64(block + 32 + 256)), 0x10));
  if constexpr (std::is_same_v<Format, Q6_K>)
    row = or8(row, and8(shift16<4 - 2 * (J % 4)>(load64(block + 32 + 256 + 64 * (J / 4))), 0x30));
  return row;
}

// One widening group (rows G .. G + kPerWiden - 1) of a block against T rows of activations: each code row decoded
// once and multiplied with every activation row while it is in a register, the T int16 sums kept in registers (2 T +
// 4 of the 16), then widened by the group's scale into sums. Decoding all 8 rows first, as group_product does, left
// 16 registers of codes live and the compiler spilled every product (~2 stack moves a VPMADDUBSW).
template <class Format, int T, int G>
inline void scaled_group(const uint8_t* block, const int8_t* const x[T], Scales scale, I32 sums[T]) {
  __m256i lo[T], hi[T];
  for (int t = 0; t < T; ++t) lo[t] = hi[t] = _mm256_setzero_si256();
  [&]<int... W>(std::integer_sequence<int, W...>) {
    (
        [&] {
          const U8 row = quant_row<Format, G + W>(block);
          for (int t = 0; t < T; ++t) {
            int32_t v;
            std::memcpy(&v, x[t] + 4 * (G + W), 4);
            const __m256i b = _mm256_set1_epi32(v);
            lo[t] = _mm256_add_epi16(lo[t], _mm256_maddubs_epi16(row.lo, b));
            hi[t] = _mm256_add_epi16(hi[t], _mm256_maddubs_epi16(row.hi, b));
          }
        }(),
        ...);
  }(std::make_integer_sequence<int, Format::kPerWiden>{});
  for (int t = 0; t < T; ++t)
    sums[t] = {_mm256_add_epi32(sums[t].lo, _mm256_madd_epi16(lo[t], scale.lo)),
               _mm256_add_epi32(sums[t].hi, _mm256_madd_epi16(hi[t], scale.hi))};
}

// A block's 8 code rows against T activation rows, group by group (a q6_k group never straddles its two halves).
template <class Format, int T>
inline void scaled_block(const uint8_t* block, const int8_t* const x[T], Scales first, Scales second, I32 sums[T]) {
  [&]<int... Gi>(std::integer_sequence<int, Gi...>) {
    (scaled_group<Format, T, Gi * Format::kPerWiden>(block, x, Gi * Format::kPerWiden < 4 ? first : second, sums),
     ...);
  }(std::make_integer_sequence<int, 8 / Format::kPerWiden>{});
}
#endif

// T input rows (from row `row`) against one group of 16 outputs, with SuperActivations.
template <class Format, int T>
void super_product(const uint8_t* group, int64_t supers, const SuperActivations& a, int64_t row, int64_t K,
                   const float* bias, float* y, int64_t N, int64_t n0) {
  constexpr bool kSixBit = std::is_same_v<Format, Q6_K>;
  F32 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = zero_f();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* super = group + s * super_bytes<Format>();
    I32 sums[T], offsets[T];
    for (int t = 0; t < T; ++t) sums[t] = offsets[t] = zero_i();
    for (int b = 0; b < kBlocksPerSuper; ++b) {
      const uint8_t* block = super + Format::kHeader + b * Format::kBlockBytes;
      prefetch_block(block, Format::kBlockBytes);
#if defined(LMSERVE_INT16_KERNELS_AVX2)
      {
        const int8_t* x[T];
        for (int t = 0; t < T; ++t) x[t] = a.q.data() + (row + t) * K + s * kSuper + b * kBlock;
        if constexpr (kSixBit) {
          scaled_block<Format, T>(block, x, scales_signed(block), scales_signed(block + 16), sums);
          const I32 pairs = byte_pairs(block, block + 16, true);
          for (int t = 0; t < T; ++t)
            offsets[t] = madd_pairs(offsets[t], pairs, two_sums(a.sum16.data() + ((row + t) * K + s * kSuper) / 16 + 2 * b));
        } else {
          const Scales scale = scales_unsigned(block);
          scaled_block<Format, T>(block, x, scale, scale, sums);
        }
        continue;
      }
#endif
      U8 rows[8];
      Format::quants(block, rows);
      if constexpr (kSixBit) {
        const Scales first = scales_signed(block), second = scales_signed(block + 16);
        const I32 pairs = byte_pairs(block, block + 16, true);  // (sc of the first 16 inputs, of the second)
        for (int t = 0; t < T; ++t) {
          const int8_t* x = a.q.data() + (row + t) * K + s * kSuper + b * kBlock;
          sums[t] = dot_rows_scaled<Format::kPerWiden>(sums[t], rows, 4, x, first);
          sums[t] = dot_rows_scaled<Format::kPerWiden>(sums[t], rows + 4, 4, x + 16, second);
          offsets[t] = madd_pairs(offsets[t], pairs, two_sums(a.sum16.data() + ((row + t) * K + s * kSuper) / 16 + 2 * b));
        }
      } else {
        const Scales scale = scales_unsigned(block);
        for (int t = 0; t < T; ++t) {
          const int8_t* x = a.q.data() + (row + t) * K + s * kSuper + b * kBlock;
          sums[t] = dot_rows_scaled<Format::kPerWiden>(sums[t], rows, 8, x, scale);
        }
      }
    }
    const F32 d = widen16(super);
    if constexpr (kSixBit) {
      for (int t = 0; t < T; ++t) {
        const F32 s_x = set1(a.scale[(row + t) * supers + s]);
        acc[t] = fmadd(to_float(sub_i(sums[t], shift_left32<5>(offsets[t]))), mul(d, s_x), acc[t]);
      }
    } else {
      // The minimums: mn of blocks 2p and 2p + 1 as pairs against the rows' sums over those blocks.
      I32 minimums[kBlocksPerSuper / 2];
      for (int p = 0; p < kBlocksPerSuper / 2; ++p) {
        const uint8_t* block = super + Format::kHeader + 2 * p * Format::kBlockBytes;
        minimums[p] = byte_pairs(block + 16, block + Format::kBlockBytes + 16, false);
      }
      const F32 dmin = widen16(super + 32);
      for (int t = 0; t < T; ++t) {
        const int16_t* sum32 = a.sum32.data() + ((row + t) * K + s * kSuper) / kBlock;
        I32 m = zero_i();
        for (int p = 0; p < kBlocksPerSuper / 2; ++p) m = madd_pairs(m, minimums[p], two_sums(sum32 + 2 * p));
        const F32 s_x = set1(a.scale[(row + t) * supers + s]);
        acc[t] = fmadd(to_float(sums[t]), mul(d, s_x), acc[t]);
        acc[t] = fnmadd(to_float(m), mul(dmin, s_x), acc[t]);
      }
    }
  }
  const F32 bv = bias ? loadu(bias + n0) : zero_f();
  for (int t = 0; t < T; ++t) storeu(y + (row + t) * N + n0, add(acc[t], bv));
}

// Activation rows a tile of the per-256 product takes: on AVX2 four (scaled_group keeps 2 T + 4 registers live, and
// each decoded code row serves four activation rows; q6_k's per-32 tile of two decoded its rows for every two).
template <class Format>
constexpr int kSuperTileRows = kAvx512 ? Format::kTileRows8 : 4;

template <class Format, int T = kSuperTileRows<Format>>
void super_tile(int rows, const uint8_t* group, int64_t supers, const SuperActivations& a, int64_t row, int64_t K,
                const float* bias, float* y, int64_t N, int64_t n0) {
  if constexpr (T > 1) {
    if (rows < T) return super_tile<Format, T - 1>(rows, group, supers, a, row, K, bias, y, N, n0);
  }
  super_product<Format, T>(group, supers, a, row, K, bias, y, N, n0);
}

template <class Format>
void check_weight(const at::Tensor& weight, int64_t N, int64_t K) {
  check_packed_weight(weight, Format::kName, N, K, kSuper, K / kSuper * super_bytes<Format>());
}

template <class Format, bool kLow, int T = kLow ? Format::kTileRows : Format::kTileRows8>
void tile(int rows, const uint8_t* group, int64_t blocks, const Activations& a, int64_t row, int64_t K,
          const float* bias, float* y, int64_t N, int64_t n0) {
  if constexpr (T > 1) {
    if (rows < T) return tile<Format, kLow, T - 1>(rows, group, blocks, a, row, K, bias, y, N, n0);
  }
  group_product<Format, T, kLow>(group, blocks, a, row, K, bias, y, N, n0);
}

// kLow: 16-bit activations (`_int16_linear`); without it 8-bit ones (`_int8_linear`), on the same weights.
template <class Format, bool kLow = true>
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, int64_t out_features,
                     const c10::optional<at::Tensor>& bias) {
  LinearCall call = linear_call(input, out_features, bias);
  const int64_t K = call.K, N = call.N, M = call.M, blocks = K / kBlock;
  check_weight<Format>(weight, N, K);
  if (M == 0) return call.y.view(call.out_shape);
  float* yp = call.y.data_ptr<float>();
  if constexpr (!kLow && kSuperScaled<Format>) {
    if (kquant_super_scale.load(std::memory_order_relaxed)) {
      SuperActivations a;
      split_super_rows(call.x.data_ptr<float>(), M, K, a);
      for_each_tile<kSuperTileRows<Format>>(M, N, K / kSuper * super_bytes<Format>(), K, weight.data_ptr<uint8_t>(),
                                        [&](int rows, const uint8_t* group, int64_t row, int64_t n0) {
                                          super_tile<Format>(rows, group, K / kSuper, a, row, K, call.bias, yp, N, n0);
                                        });
      return call.y.view(call.out_shape);
    }
  }
  Activations a;
  split<true>(call.x.data_ptr<float>(), M, K, a);
  constexpr int kRows = kLow ? Format::kTileRows : Format::kTileRows8;
  for_each_tile<kRows>(M, N, K / kSuper * super_bytes<Format>(), K * (kLow ? 2 : 1), weight.data_ptr<uint8_t>(),
                       [&](int rows, const uint8_t* group, int64_t row, int64_t n0) {
                         tile<Format, kLow>(rows, group, blocks, a, row, K, call.bias, yp, N, n0);
                                   });
  return call.y.view(call.out_shape);
}

// The file's blocks, uint8 [N, K / 256, bytes] (in parts: BlockRows), in the layout at the top: uint8 [N / 16, K / 256 *
// super_bytes].
// What worker/weights/kquants.py's NumPy packer does (tests hold them equal), on every thread and without a
// temporary the size of the weights.
struct SourceQ4_K {  // llama.cpp's block_q4_K: d, dmin, 12 bytes of 6-bit scales and minimums, 128 bytes of nibbles
  static constexpr int64_t kBytes = 144;
  static void scales(const uint8_t* src, uint8_t sc[8], uint8_t mn[8]) {
    const uint8_t* s = src + 4;
    for (int j = 0; j < 4; ++j) {
      sc[j] = s[j] & 63;
      mn[j] = s[j + 4] & 63;
      sc[j + 4] = static_cast<uint8_t>((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
      mn[j + 4] = static_cast<uint8_t>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
  }
  // All 256 codes, in loops over 32 bytes that the compiler vectorizes (each source's codes() does: a per-weight
  // function was most of a 1.5B model's start-up). Weight 64 c + 32 h + p: nibble h of byte 16 + 32 c + p.
  static void codes(const uint8_t* src, uint8_t out[kSuper]) {
    for (int c = 0; c < 4; ++c)
      for (int p = 0; p < 32; ++p) {
        const uint8_t byte = src[16 + 32 * c + p];
        out[64 * c + p] = byte & 0x0F;
        out[64 * c + 32 + p] = byte >> 4;
      }
  }
};
struct SourceQ5_K {  // block_q5_K: d, dmin, 12 bytes of scales and minimums, 32 of fifth bits, 128 of nibbles
  static constexpr int64_t kBytes = 176;
  static void scales(const uint8_t* src, uint8_t sc[8], uint8_t mn[8]) { SourceQ4_K::scales(src, sc, mn); }
  static void codes(const uint8_t* src, uint8_t out[kSuper]) {
    for (int c = 0; c < 4; ++c)
      for (int p = 0; p < 32; ++p) {
        const uint8_t byte = src[48 + 32 * c + p], fifth = src[16 + p];
        out[64 * c + p] = static_cast<uint8_t>((byte & 0x0F) | (((fifth >> (2 * c)) & 1) << 4));
        out[64 * c + 32 + p] = static_cast<uint8_t>((byte >> 4) | (((fifth >> (2 * c + 1)) & 1) << 4));
      }
  }
};
struct SourceQ6_K {  // block_q6_K: 128 bytes of low nibbles, 64 of top bits, 16 int8 scales, d
  static constexpr int64_t kBytes = 210, kScaleAt = 208;
  static void codes(const uint8_t* src, uint8_t out[kSuper]) {  // w = 128 h + 32 j + p
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int p = 0; p < 32; ++p)
          out[128 * h + 32 * j + p] = static_cast<uint8_t>(((src[64 * h + 32 * (j % 2) + p] >> (4 * (j / 2))) & 0x0F) |
                                                           (((src[128 + 32 * h + p] >> (2 * j)) & 3) << 4));
  }
  static uint8_t scale(const uint8_t* src, int j) { return src[192 + j]; }
};
struct SourceQ2_K {  // block_q2_K: 16 bytes of 4-bit scales (low) and minimums (high), 64 of 2-bit codes, d, dmin
  static constexpr int64_t kBytes = 84;
  // Weight 128 h + 32 j + p: bits 2j of byte 16 + 32 h + p.
  static void codes(const uint8_t* src, uint8_t out[kSuper]) {
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int p = 0; p < 32; ++p) out[128 * h + 32 * j + p] = static_cast<uint8_t>((src[16 + 32 * h + p] >> (2 * j)) & 3);
  }
};
struct SourceQ3_K {  // block_q3_K: 32 bytes of third bits (hmask), 64 of 2-bit codes, 12 of 6-bit scales, d
  static constexpr int64_t kBytes = 110, kScaleAt = 108;
  // Weight 128 h + 32 j + p: bits 2j of byte 32 h + p, its third bit at bit 4 h + j of hmask byte p; q = that + 4.
  static void codes(const uint8_t* src, uint8_t out[kSuper]) {
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int p = 0; p < 32; ++p)
          out[128 * h + 32 * j + p] = static_cast<uint8_t>(((src[32 + 32 * h + p] >> (2 * j)) & 3) |
                                                           (((src[p] >> (4 * h + j)) & 1) << 2));
  }
  // Sub-block j's ls - 32 as an int8 byte: its low 4 bits in byte j % 8 (the high nibble from j = 8), the top 2 in
  // byte 8 + j % 4 at bit 2 (j / 4).
  static uint8_t scale(const uint8_t* src, int j) {
    const uint8_t* s = src + 96;
    const int ls = ((s[j % 8] >> (4 * (j / 8))) & 0x0F) | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4);
    return static_cast<uint8_t>(static_cast<int8_t>(ls - 32));
  }
};

template <class Format>
at::Tensor pack(at::TensorList parts) {
  constexpr bool kSixBit = std::is_same_v<Format, Q6_K>, kThreeBit = std::is_same_v<Format, Q3_K>;
  constexpr bool kTwoBit = std::is_same_v<Format, Q2_K>;
  constexpr bool kFiveBit = std::is_same_v<Format, Q5_K>;
  using Source = std::conditional_t<
      kSixBit, SourceQ6_K,
      std::conditional_t<kThreeBit, SourceQ3_K,
                         std::conditional_t<kTwoBit, SourceQ2_K,
                                            std::conditional_t<kFiveBit, SourceQ5_K, SourceQ4_K>>>>;
  const BlockRows rows(parts, Source::kBytes, Format::kName);
  const int64_t N = rows.size(), supers = rows.blocks;
  TORCH_CHECK(N % kGroup == 0, Format::kName, " layers need out_features that are a multiple of 16, got ", N);
  at::Tensor out = at::empty({N / kGroup, supers * super_bytes<Format>()}, at::kByte);
  uint8_t* out_all = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / kGroup, 4, [&](int64_t begin, int64_t end) {
    uint8_t codes[kGroup][kSuper];
    uint8_t first[kGroup][kBlocksPerSuper], second[kGroup][kBlocksPerSuper];  // q4_k: sc, mn; q6_k: the halves'
    uint8_t third[kGroup][kBlocksPerSuper], fourth[kGroup][kBlocksPerSuper];  // q2_k: the halves' mn
    for (int64_t g = begin; g < end; ++g)
      for (int64_t s = 0; s < supers; ++s) {
        uint8_t* dst = out_all + (g * supers + s) * super_bytes<Format>();
        for (int n = 0; n < kGroup; ++n) {
          const uint8_t* src = rows.row[g * kGroup + n] + s * Source::kBytes;
          if constexpr (kTwoBit) {
            std::memcpy(dst + 2 * n, src + 80, 2);
            std::memcpy(dst + 32 + 2 * n, src + 82, 2);
            for (int b = 0; b < kBlocksPerSuper; ++b) {
              first[n][b] = src[2 * b] & 0x0F;
              second[n][b] = src[2 * b + 1] & 0x0F;
              third[n][b] = src[2 * b] >> 4;
              fourth[n][b] = src[2 * b + 1] >> 4;
            }
          } else if constexpr (kHalfBlocks<Format>) {
            std::memcpy(dst + 2 * n, src + Source::kScaleAt, 2);
            for (int b = 0; b < kBlocksPerSuper; ++b) {
              first[n][b] = Source::scale(src, 2 * b);
              second[n][b] = Source::scale(src, 2 * b + 1);
            }
          } else {
            std::memcpy(dst + 2 * n, src, 2);
            std::memcpy(dst + 32 + 2 * n, src + 2, 2);
            Source::scales(src, first[n], second[n]);
          }
          Source::codes(src, codes[n]);
        }
        for (int b = 0; b < kBlocksPerSuper; ++b) {
          uint8_t* block = dst + Format::kHeader + b * Format::kBlockBytes;
          const uint8_t* q[kGroup];
          for (int n = 0; n < kGroup; ++n) {
            block[n] = first[n][b];
            block[16 + n] = second[n][b];
            q[n] = codes[n] + kBlock * b;
          }
          if constexpr (kTwoBit) {
            for (int n = 0; n < kGroup; ++n) {
              block[32 + n] = third[n][b];
              block[48 + n] = fourth[n][b];
            }
            two_bit_chunks(block + 64, q, 0);
          } else if constexpr (kThreeBit) {
            two_bit_chunks(block + 32, q, 0);
            bit_plane_chunk(block + 32 + 128, q, 2);  // the third bit, read as q5_k's fifth
          } else {
            nibble_chunks(block + 32, q);
            if constexpr (kFiveBit) bit_plane_chunk(block + 32 + 256, q, 4);
            if constexpr (kSixBit) two_bit_chunks(block + 32 + 256, q, 4);
          }
        }
      }
  });
  return out;
}

// The float32 weights [N, K]: gguf's values bit for bit (q4_k: (d sc) q - dmin mn, one rounding as an FMA of exact
// terms; q6_k, q3_k: (d sc) (q - offset), exact).
template <class Format>
void dequantize(const at::Tensor& weight, at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2,
              "out must be [N, K] float32");
  const int64_t N = out.size(0), K = out.size(1), blocks = K / kBlock;
  check_weight<Format>(weight, N, K);
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t group_bytes = K / kSuper * super_bytes<Format>();
  at::parallel_for(0, N / kGroup, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* super = wp + g * group_bytes + b / kBlocksPerSuper * super_bytes<Format>();
        const uint8_t* block = super + Format::kHeader + b % kBlocksPerSuper * Format::kBlockBytes;
        alignas(64) float second[16], first_scale[16], minimum[2][16];
        if constexpr (std::is_same_v<Format, Q2_K>) {
          storeu(first_scale, mul(widen16(super), bytes_unsigned(block)));
          storeu(second, mul(widen16(super), bytes_unsigned(block + 16)));  // the second half's scale
          storeu(minimum[0], mul(widen16(super + 32), bytes_unsigned(block + 32)));
          storeu(minimum[1], mul(widen16(super + 32), bytes_unsigned(block + 48)));
        } else if constexpr (!kHalfBlocks<Format>) {
          storeu(first_scale, mul(widen16(super), bytes_unsigned(block)));
          storeu(second, mul(widen16(super + 32), bytes_unsigned(block + 16)));  // dmin mn
        } else {
          storeu(first_scale, mul(widen16(super), bytes_signed(block)));
          storeu(second, mul(widen16(super), bytes_signed(block + 16)));  // the second half's scale
        }
        for (int n = 0; n < kGroup; ++n)
          for (int k = 0; k < kBlock; ++k) {
            const float q = static_cast<float>(Format::quant(block, n, k));
            float* dst = op + (g * kGroup + n) * K + b * kBlock + k;
            if constexpr (std::is_same_v<Format, Q2_K>)
              *dst = std::fma(q, k < 16 ? first_scale[n] : second[n], -minimum[k / 16][n]);
            else if constexpr (!kHalfBlocks<Format>) *dst = std::fma(q, first_scale[n], -second[n]);
            else *dst = (q - static_cast<float>(Format::kOffset)) * (k < 16 ? first_scale[n] : second[n]);
          }
      }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmserve, m) {
  // Whether the int8 q4_k, q5_k and q6_k products take one activation scale per 256 inputs (on) or per 32 (off);
  // returns the setting it replaces. Set before a model runs, not during.
  m.def("set_kquant_super_scale(bool enabled) -> bool", [](bool enabled) { return kquant_super_scale.exchange(enabled); });
  m.def("q4_k_int16_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q4_k_int8_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q4_k_int16_dequantize(Tensor weight, Tensor(a!) out) -> ()");
  m.def("q4_k_int16_pack(Tensor[] parts) -> Tensor");
  m.def("q6_k_int16_pack(Tensor[] parts) -> Tensor");
  m.def("q5_k_int16_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q5_k_int8_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q5_k_int16_dequantize(Tensor weight, Tensor(a!) out) -> ()");
  m.def("q5_k_int16_pack(Tensor[] parts) -> Tensor");
  m.def("q6_k_int16_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q6_k_int8_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q6_k_int16_dequantize(Tensor weight, Tensor(a!) out) -> ()");
  m.def("q3_k_int16_pack(Tensor[] parts) -> Tensor");
  m.def("q2_k_int16_pack(Tensor[] parts) -> Tensor");
  m.def("q2_k_int16_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q2_k_int8_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q2_k_int16_dequantize(Tensor weight, Tensor(a!) out) -> ()");
  m.def("q3_k_int16_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q3_k_int8_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q3_k_int16_dequantize(Tensor weight, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(lmserve, CPU, m) {
  m.impl("q4_k_int16_linear", &linear<Q4_K>);
  m.impl("q4_k_int8_linear", &linear<Q4_K, false>);
  m.impl("q4_k_int16_pack", &pack<Q4_K>);
  m.impl("q6_k_int16_pack", &pack<Q6_K>);
  m.impl("q5_k_int16_linear", &linear<Q5_K>);
  m.impl("q5_k_int8_linear", &linear<Q5_K, false>);
  m.impl("q5_k_int16_pack", &pack<Q5_K>);
  m.impl("q5_k_int16_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<Q5_K>(w, out); });
  m.impl("q4_k_int16_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<Q4_K>(w, out); });
  m.impl("q6_k_int16_linear", &linear<Q6_K>);
  m.impl("q6_k_int8_linear", &linear<Q6_K, false>);
  m.impl("q6_k_int16_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<Q6_K>(w, out); });
  m.impl("q3_k_int16_pack", &pack<Q3_K>);
  m.impl("q2_k_int16_pack", &pack<Q2_K>);
  m.impl("q2_k_int16_linear", &linear<Q2_K>);
  m.impl("q2_k_int8_linear", &linear<Q2_K, false>);
  m.impl("q2_k_int16_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<Q2_K>(w, out); });
  m.impl("q3_k_int16_linear", &linear<Q3_K>);
  m.impl("q3_k_int8_linear", &linear<Q3_K, false>);
  m.impl("q3_k_int16_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<Q3_K>(w, out); });
}

#endif  // LMSERVE_INT16_KERNELS: AVX-512 VNNI, or AVX2 with FMA and F16C
