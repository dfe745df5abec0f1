// q4_1, q8_0, q4_0, q5_0, q5_1, iq4_nl and mxfp4 linear layers with the activations as 16-bit integers per block of 32:
// y = x @ W.T (+ bias), built for AVX-512 VNNI or AVX2 from one source over int16_simd.h's primitives.
//
// The float32 block kernel (quantized_linear.cpp) widens every weight to a float and spends an FMA on it: on a
// 2-core AVX-512 VM 16 decode rows cost about 6x one row. Integer dot products cost a quarter of that per
// weight (VPDPBUSD: 64 products of unsigned bytes by signed bytes into 16 int32 lanes; on AVX2 VPMADDUBSW and
// VPMADDWD), and they are exact, so every
// row's result is the same whatever the rows beside it or the order of the work: batch-invariant by arithmetic.
//
// Activations: per row and block of 32 inputs, s = max|x| / 127, x_hi = round(x / s) in -127..127 and
// x_lo = round((x - s x_hi) * 256 / s) in -128..127 (AVX2: -127..127, see int16_simd.h): x = (s / 256) (256 x_hi + x_lo) to within s / 512, a 16-bit
// fixed point of the block's range; the block's float32 sum of x is kept for the minimums. llama.cpp quantizes them
// to one int8 per block: on this model's MLP inputs (outliers ~1,000x their median) that moved the next-token
// distribution by a KL of 0.0036 from the float32 model over the shipped prose (simulated), where this kernel's two
// halves move it by < 1e-5 and bfloat16 activations by 1e-4 (docs/benchmarks.md).
// Weights: q4_1's w = d q + m with q in 0..15 as unsigned bytes, so per block and output
//   y += d (s / 256) (256 (q . x_hi) + (q . x_lo)) + m sum(x),
// where both dot products are exact int32 and 256 (q . x_hi) + (q . x_lo) < 2^24 is exact in float32.
//
// q8_0's w = d q with q in -128..127 is taken as the unsigned q + 128, and 128 (sum of x_hi) (and of x_lo) taken off
// the dot products, still exact (on AVX2 the signed q goes through dot4_signed instead); there 256 (q . x_hi) +
// (q . x_lo) can pass 2^24, so it is one FMA in float32.
//
// Layout, per group of 16 output rows and block of 32 inputs: VPDPBUSD wants, per 32-bit lane n, 4 consecutive inputs
// of output n, so the quants come as 8 rows of 64 bytes, row j (0..7) holding q[n][4j..4j+3] for n = 0..15.
//   q4_1 (320 bytes, its 0.625 bytes per weight): the 16 d's (float16), the 16 m's (float16), then 4 chunks of 64
//   bytes, chunk c holding row 2c in its low nibbles and row 2c + 1 in its high ones.
//   q8_0 (544 bytes, its 1.0625): the 16 d's, then the 8 rows of q + 128.
//   q5_0 and q5_1: see Five below; q4_0 and iq4_nl: Q4_0 and IQ4_NL below.
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
#include <type_traits>
#include <vector>

#include "int16_simd.h"

#if defined(LMSERVE_INT16_KERNELS)

namespace {

using namespace lmserve_int16;

// A block's 32 codes from the 16 bytes at `nibbles` that hold code k in the low nibble of byte k and code k + 16 in
// the high one (llama.cpp's q4_0, q4_1, q5_0, q5_1 and iq4_nl blocks), with SSE (every int16 build has AVX2): a
// code at a time, the packers of these formats ran at 0.9-1.7 GB/s on the AVX2 build.
inline void nibble_codes(const uint8_t* nibbles, uint8_t out[kBlock]) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles)), low = _mm_set1_epi8(0x0F);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_and_si128(v, low));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm_and_si128(_mm_srli_epi16(v, 4), low));
}

// Bit k of the 4 bytes at `bits` (little-endian) as 16 added to code k: q5_0's and q5_1's fifth bits.
inline void add_fifth_bits(const uint8_t* bits, uint8_t out[kBlock]) {
  const __m128i select = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int h = 0; h < 2; ++h) {  // codes 16h .. 16h + 15: bytes 2h and 2h + 1 of the bits
    uint16_t two;
    std::memcpy(&two, bits + 2 * h, 2);
    const __m128i each = _mm_and_si128(_mm_shuffle_epi8(_mm_cvtsi32_si128(two), spread), select);
    const __m128i sixteen = _mm_and_si128(_mm_cmpeq_epi8(each, select), _mm_set1_epi8(16));
    __m128i* at = reinterpret_cast<__m128i*>(out + 16 * h);
    _mm_storeu_si128(at, _mm_or_si128(_mm_loadu_si128(at), sixteen));
  }
}

struct Q4_1 {
  static constexpr const char* kName = "q4_1";
  static constexpr int64_t kSourceBytes = 20;  // llama.cpp's block_q4_1: d, m, 16 bytes of nibbles
  static constexpr int64_t kScaleBytes = 64;   // 16 d's, 16 m's
  static constexpr int64_t kBytes = kScaleBytes + 256;
  static constexpr int32_t kOffset = 0;        // codes stored as they are
  static constexpr int kPerWiden = 8;          // int16_simd.h's dot_rows on AVX2: codes <= 15
  static inline void quants(const uint8_t* block, U8 rows[8]) { low_nibbles(block + kScaleBytes, rows); }
  // The codes q[k] of a source block, k in 0..31.
  static inline void source_codes(const uint8_t* block, uint8_t out[kBlock]) { nibble_codes(block + 4, out); }
};

struct Q8_0 {
  static constexpr const char* kName = "q8_0";
  static constexpr int64_t kSourceBytes = 34;  // d, 32 int8
  static constexpr int64_t kScaleBytes = 32;   // 16 d's
  static constexpr int64_t kBytes = kScaleBytes + 512;
  static constexpr int32_t kOffset = 128;      // q + 128, unsigned
  static constexpr int kPerWiden = 1;
  static inline void quants(const uint8_t* block, U8 rows[8]) {
    for (int j = 0; j < 8; ++j) rows[j] = load64(block + kScaleBytes + 64 * j);
  }
  static inline void source_codes(const uint8_t* block, uint8_t out[kBlock]) {  // q + 128: the sign bit flipped
    for (int k = 0; k < kBlock; ++k) out[k] = static_cast<uint8_t>(block[2 + k] ^ 0x80);
  }
};

// q5_0: w = d (q - 16) with q in 0..31 (5 bits). The low 4 bits as q4_1's nibble chunks, the fifth bits as one more
// chunk of 64 bytes whose byte 4n + e holds in bit j the fifth bit of q[n][4j + e]: 352 bytes, the file's 0.6875 bytes
// a weight. 16 (sum of x_hi), 16 (sum of x_lo) come off the exact dot products, as q8_0's 128 does.
// q5_1: w = d q + m, q in 0..31: q4_1's scales and q5_0's codes, 384 bytes (the file's 0.75 bytes a weight).
template <bool kMinimum>
struct Five {
  static constexpr const char* kName = kMinimum ? "q5_1" : "q5_0";
  static constexpr int64_t kSourceBytes = kMinimum ? 24 : 22;  // d, (m,) 4 bytes of fifth bits, 16 bytes of nibbles
  static constexpr int64_t kScaleBytes = kMinimum ? 64 : 32;   // 16 d's (, 16 m's)
  static constexpr int64_t kBytes = kScaleBytes + 256 + 64;
  static constexpr int32_t kOffset = kMinimum ? 0 : 16;
  static constexpr int kPerWiden = 4;  // codes <= 31
  static inline void quants(const uint8_t* block, U8 rows[8]) {
    low_nibbles(block + kScaleBytes, rows);
    fifth_bits(block + kScaleBytes + 256, rows);
  }
  static inline void source_codes(const uint8_t* block, uint8_t out[kBlock]) {
    const uint8_t* at = block + kSourceBytes - 20;  // the fifth bits, then the nibbles
    nibble_codes(at + 4, out);
    add_fifth_bits(at, out);
  }
};
using Q5_0 = Five<false>;
using Q5_1 = Five<true>;

// q4_0: w = d (q - 8), q in 0..15: q4_1's nibble chunks after the 16 d's (288 bytes, the file's 0.5625 bytes a
// weight); 8 (sum of x_hi), 8 (sum of x_lo) come off the exact dot products.
struct Q4_0 {
  static constexpr const char* kName = "q4_0";
  static constexpr int64_t kSourceBytes = 18;  // llama.cpp's block_q4_0: d, 16 bytes of nibbles
  static constexpr int64_t kScaleBytes = 32;   // 16 d's
  static constexpr int64_t kBytes = kScaleBytes + 256;
  static constexpr int32_t kOffset = 8;
  static constexpr int kPerWiden = 8;  // codes <= 15
  static inline void quants(const uint8_t* block, U8 rows[8]) { low_nibbles(block + kScaleBytes, rows); }
  static inline void source_codes(const uint8_t* block, uint8_t out[kBlock]) { nibble_codes(block + 2, out); }
};

// iq4_nl: w = d v[q], with q in 0..15 an index into llama.cpp's table kvalues_iq4nl of 16 int8 values (-127..113).
// q4_1's nibble chunks after the 16 d's (288 bytes, the file's 0.5625 bytes a weight); the indices become v + 128 (as
// q8_0's stored codes) by one byte shuffle per 64 codes, so the products and the 128 (sum) taken off are q8_0's.
struct IQ4_NL {
  static constexpr const char* kName = "iq4_nl";
  static constexpr int64_t kSourceBytes = 18;  // llama.cpp's block_iq4_nl: d, 16 bytes of nibbles (as q4_0's)
  static constexpr int64_t kScaleBytes = 32;   // 16 d's
  static constexpr int64_t kBytes = kScaleBytes + 256;
  static constexpr int32_t kOffset = 128;      // the codes the kernel multiplies: v[q] + 128, unsigned
  static constexpr int kPerWiden = 1;
  static constexpr uint8_t kValues[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
  static inline void quants(const uint8_t* block, U8 rows[8]) {
    low_nibbles(block + kScaleBytes, rows);
    for (int j = 0; j < 8; ++j) rows[j] = lookup16(rows[j], kValues);
  }
  static inline void source_codes(const uint8_t* block, uint8_t out[kBlock]) { Q4_0::source_codes(block, out); }
};

// mxfp4 (OCP microscaling, gpt-oss's experts; llama.cpp's block_mxfp4): one E8M0 byte e, then q4_0's 16 bytes of
// nibbles, each an E2M1 value; w = 2^(e - 127) fp4[q], or, with llama.cpp's table of the values doubled
// (kvalues_mxfp4: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives), w = 2^(e - 128) v[q]. Packed as iq4_nl is, the
// power of two as the block's float16 d (exact where 2^(e - 128) is one: e in 104..143, as every scale of a trained
// model's weights; the packer refuses another) and the indices as v + 16 (4..28, q5_0's range and offset: the
// unsigned products of every build, without iq4_nl's signed path), 288 bytes for the file's 272.
struct MXFP4 {
  static constexpr const char* kName = "mxfp4";
  static constexpr int64_t kSourceBytes = 17;  // e, 16 bytes of nibbles
  static constexpr int64_t kScaleBytes = 32;   // 16 d's
  static constexpr int64_t kBytes = kScaleBytes + 256;
  static constexpr int32_t kOffset = 16;
  static constexpr int kPerWiden = 4;  // codes <= 28
  static constexpr uint8_t kValues[16] = {16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4};
  static inline void quants(const uint8_t* block, U8 rows[8]) {
    low_nibbles(block + kScaleBytes, rows);
    for (int j = 0; j < 8; ++j) rows[j] = lookup16(rows[j], kValues);
  }
  static inline void source_codes(const uint8_t* block, uint8_t out[kBlock]) { nibble_codes(block + 1, out); }
  // The block's d, 2^(e - 128), as float16 bits.
  static inline uint16_t source_scale(const uint8_t* block) {
    const int exponent = static_cast<int>(block[0]) - 128;
    TORCH_CHECK(exponent >= -24 && exponent <= 15, "mxfp4 block scale 2^", exponent,
                " is outside float16's range (2^-24 .. 2^15)");
    return exponent >= -14 ? static_cast<uint16_t>((exponent + 15) << 10)        // normal: biased exponent
                           : static_cast<uint16_t>(1u << (exponent + 24));      // subnormal: 2^-24 units
  }
};

// Input rows that share one decoding of the weights: 6 on AVX-512 (1.03-1.12x over 4); AVX2 has half the registers,
// each value taking two.
constexpr int kTileRows = kAvx512 ? 6 : 2;
// With 8-bit activations (the high halves alone) a row needs half the accumulators: more rows share one decoding.
constexpr int kTileRows8 = kAvx512 ? 8 : 4;
// q8_0's and iq4_nl's codes on AVX2 go through dot4_signed (int16_simd.h): their + 128 would saturate VPMADDUBSW's
// pairs.
template <class Format>
constexpr bool kSignedCodes = !kAvx512 && (std::is_same_v<Format, Q8_0> || std::is_same_v<Format, IQ4_NL>);

// T input rows (from row `row`) against one group, all blocks. kLow: both activation halves (16-bit activations);
// without it the high halves alone, x ~ s x_hi: llama.cpp's 8 bits a block (prompt rows, --batched-weights
// prompt-int8), half the integer products.
template <class Format, int T, bool kLow = true>
void group_product(const uint8_t* group, int64_t blocks, const Activations& a, int64_t row, int64_t K,
                   const float* bias, float* y, int64_t N, int64_t n0) {
  F32 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = zero_f();
  const int8_t* high = a.high.data() + row * K;
  const int8_t* low = a.low.data() + row * K;
  const int64_t first = row * blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * Format::kBytes;
    prefetch_block(block, Format::kBytes);
    U8 rows[8];
    Format::quants(block, rows);
    I32 dot_high[T], dot_low[T];
    for (int t = 0; t < T; ++t) dot_high[t] = dot_low[t] = zero_i();
    if constexpr (kSignedCodes<Format>) {
#if defined(LMSERVE_INT16_KERNELS_AVX2)
      for (int j = 0; j < 8; ++j) {
        const U8 q = flip_top_bits(rows[j]), magnitude = abs8(q);
        for (int t = 0; t < T; ++t) {
          const int64_t at = t * K + b * kBlock + 4 * j;
          dot_high[t] = dot4_signed(dot_high[t], magnitude, q, high + at);
          if constexpr (kLow) dot_low[t] = dot4_signed(dot_low[t], magnitude, q, low + at);
        }
      }
#endif
    } else if constexpr (kAvx512) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
        for (int t = 0; t < T; ++t) {
          const int64_t at = t * K + b * kBlock + 4 * j;
          dot_high[t] = dot4(dot_high[t], rows[j], high + at);
          if constexpr (kLow) dot_low[t] = dot4(dot_low[t], rows[j], low + at);
        }
    } else {
      for (int t = 0; t < T; ++t) {
        const int64_t at = t * K + b * kBlock;
        dot_high[t] = dot_rows<Format::kPerWiden>(dot_high[t], rows, 8, high + at);
        if constexpr (kLow) dot_low[t] = dot_rows<Format::kPerWiden>(dot_low[t], rows, 8, low + at);
      }
    }
    const F32 d = widen16(block);
    for (int t = 0; t < T; ++t) {
      const int64_t i = first + t * blocks + b;
      const F32 scaled_d = mul(d, set1(a.scale[i]));
      if constexpr (std::is_same_v<Format, Q4_1>) {
        // 256 (q . x_hi) + (q . x_lo) < 2^24 (q <= 15): exact in float32.
        const F32 dot = to_float(add_i(shift_left32_8(dot_high[t]), dot_low[t]));
        acc[t] = fmadd(dot, scaled_d, acc[t]);
        acc[t] = fmadd(widen16(block + 32), set1(a.sum[i]), acc[t]);
      } else if constexpr (std::is_same_v<Format, Q5_1>) {
        // q <= 31: 256 (q . x_hi) + (q . x_lo) can pass 2^24, so one FMA of the two exact dot products.
        const F32 dot = fmadd(to_float(dot_high[t]), set1(256.0f), to_float(dot_low[t]));
        acc[t] = fmadd(dot, scaled_d, acc[t]);
        acc[t] = fmadd(widen16(block + 32), set1(a.sum[i]), acc[t]);
      } else {
        // Stored codes are q + kOffset: kOffset (sum of x_hi), kOffset (sum of x_lo) off the dot products (high_sum
        // and low_sum are 128 (sum): / 8 is 16 (sum), / 16 is 8 (sum), exactly). Signed codes need none.
        static_assert(Format::kOffset == 128 || Format::kOffset == 16 || Format::kOffset == 8);
        constexpr int32_t kShift = Format::kOffset == 128 ? 0 : Format::kOffset == 16 ? 3 : 4;
        const F32 dot_h = to_float(kSignedCodes<Format> ? dot_high[t] : sub_i(dot_high[t], a.high_sum[i] >> kShift));
        const F32 dot_l = !kLow ? zero_f()
                          : to_float(kSignedCodes<Format> ? dot_low[t] : sub_i(dot_low[t], a.low_sum[i] >> kShift));
        acc[t] = fmadd(fmadd(dot_h, set1(256.0f), dot_l), scaled_d, acc[t]);
      }
    }
  }
  const F32 bv = bias ? loadu(bias + n0) : zero_f();
  for (int t = 0; t < T; ++t) storeu(y + (row + t) * N + n0, add(acc[t], bv));
}

template <class Format>
void check_weight(const at::Tensor& weight, int64_t N, int64_t K) {
  check_packed_weight(weight, Format::kName, N, K, kBlock, K / kBlock * Format::kBytes);
}

template <class Format, bool kLow, int T = kLow ? kTileRows : kTileRows8>
void tile(int rows, const uint8_t* group, int64_t blocks, const Activations& a, int64_t row, int64_t K,
          const float* bias, float* y, int64_t N, int64_t n0) {
  if constexpr (T > 1) {
    if (rows < T) return tile<Format, kLow, T - 1>(rows, group, blocks, a, row, K, bias, y, N, n0);
  }
  group_product<Format, T, kLow>(group, blocks, a, row, K, bias, y, N, n0);
}

// kLow: 16-bit activations (the `_int16_linear` ops); without it 8-bit ones (`_int8_linear`), on the same weights.
template <class Format, bool kLow = true>
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, int64_t out_features,
                     const c10::optional<at::Tensor>& bias) {
  LinearCall call = linear_call(input, out_features, bias);
  const int64_t K = call.K, N = call.N, M = call.M, blocks = K / kBlock;
  check_weight<Format>(weight, N, K);
  if (M == 0) return call.y.view(call.out_shape);
  Activations a;
  split<false>(call.x.data_ptr<float>(), M, K, a);
  float* yp = call.y.data_ptr<float>();
  for_each_tile<kLow ? kTileRows : kTileRows8>(M, N, blocks * Format::kBytes, K * (kLow ? 2 : 1),
                                                weight.data_ptr<uint8_t>(),
                           [&](int rows, const uint8_t* group, int64_t row, int64_t n0) {
                             tile<Format, kLow>(rows, group, blocks, a, row, K, call.bias, yp, N, n0);
                           });
  return call.y.view(call.out_shape);
}

// llama.cpp's blocks, uint8 [N, K / 32, bytes] (in parts: BlockRows), in the layout above: uint8 [N / 16, K / 32 *
// Format::kBytes].
template <class Format>
at::Tensor pack(at::TensorList parts) {
  const BlockRows rows(parts, Format::kSourceBytes, Format::kName);
  const int64_t N = rows.size(), num_blocks = rows.blocks;
  TORCH_CHECK(N % kGroup == 0, "out_features must be a multiple of 16, got ", N);
  at::Tensor out = at::empty({N / kGroup, num_blocks * Format::kBytes}, at::kByte);
  uint8_t* dst_all = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / kGroup, 16, [&](int64_t begin, int64_t end) {
    uint8_t codes[kGroup][kBlock];  // the 16 rows' codes of one block
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < num_blocks; ++b) {
        uint8_t* dst = dst_all + (g * num_blocks + b) * Format::kBytes;
        for (int64_t n = 0; n < kGroup; ++n) {
          const uint8_t* source_block = rows.row[g * kGroup + n] + b * Format::kSourceBytes;
          if constexpr (requires { Format::source_scale(source_block); }) {  // mxfp4: its E8M0 byte as d
            const uint16_t d = Format::source_scale(source_block);
            std::memcpy(dst + 2 * n, &d, 2);
          } else {
            for (int64_t field = 0; field < Format::kScaleBytes / 32; ++field)  // d, then (q4_1, q5_1) m
              std::memcpy(dst + 32 * field + 2 * n, source_block + 2 * field, 2);
          }
          Format::source_codes(source_block, codes[n]);
        }
        if constexpr (std::is_same_v<Format, Q8_0>) {  // row j's lane n: the codes 4j..4j+3 of output n, as they lie
          for (int j = 0; j < 8; ++j)
            for (int n = 0; n < kGroup; ++n) std::memcpy(dst + Format::kScaleBytes + 64 * j + 4 * n, &codes[n][4 * j], 4);
        } else {  // q4_1's nibble chunks, then (q5_0, q5_1) the fifth bits' chunk
          const uint8_t* q[kGroup];
          for (int n = 0; n < kGroup; ++n) q[n] = codes[n];
          nibble_chunks(dst + Format::kScaleBytes, q);
          if constexpr (Format::kBytes - Format::kScaleBytes > 256) bit_plane_chunk(dst + Format::kScaleBytes + 256, q, 4);
        }
      }
  });
  return out;
}

// The float32 weights [N, K], the same values as quantized_linear.cpp's dequantize ops (q4_1: d q + m as one FMA;
// q8_0: d q).
template <class Format>
void dequantize(const at::Tensor& weight, at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2, "out must be [N, K] float32");
  const int64_t N = out.size(0), K = out.size(1), blocks = K / kBlock;
  check_weight<Format>(weight, N, K);
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N / kGroup, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = wp + (g * blocks + b) * Format::kBytes;
        U8 rows[8];
        Format::quants(block, rows);
        alignas(64) uint8_t q[8][64];
        for (int j = 0; j < 8; ++j) store64(q[j], rows[j]);
        alignas(64) float d[16], m[16];
        storeu(d, widen16(block));
        if constexpr (Format::kScaleBytes == 64) storeu(m, widen16(block + 32));
        for (int n = 0; n < kGroup; ++n)
          for (int k = 0; k < kBlock; ++k) {
            const int stored = q[k / 4][4 * n + k % 4];
            float* dst = op + (g * kGroup + n) * K + b * kBlock + k;
            if constexpr (Format::kScaleBytes == 64) *dst = std::fma(static_cast<float>(stored), d[n], m[n]);
            else *dst = static_cast<float>(stored - Format::kOffset) * d[n];
          }
      }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmserve, m) {
  m.def("int16_uses_vnni() -> bool", [] { return kAvx512; });
  // Whether the AVX2 build splits activations with split_rows_avx2 (int16_simd.h's avx2_vector_split); returns the
  // setting it replaces. The VNNI build has one split: always false there.
  m.def("set_avx2_split(bool enabled) -> bool", [](bool enabled) {
#if defined(LMSERVE_INT16_KERNELS_AVX2)
    return avx2_vector_split.exchange(enabled);
#else
    (void)enabled;
    return false;
#endif
  });
  m.def("q4_1_int16_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q4_1_int16_pack(Tensor[] parts) -> Tensor");
  m.def("q4_1_int8_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q4_1_int16_dequantize(Tensor weight, Tensor(a!) out) -> ()");
  m.def("q8_0_int16_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q8_0_int16_pack(Tensor[] parts) -> Tensor");
  m.def("q8_0_int8_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q8_0_int16_dequantize(Tensor weight, Tensor(a!) out) -> ()");
  m.def("q5_0_int16_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q5_0_int16_pack(Tensor[] parts) -> Tensor");
  m.def("q5_0_int8_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q5_0_int16_dequantize(Tensor weight, Tensor(a!) out) -> ()");
  m.def("q5_1_int16_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q5_1_int16_pack(Tensor[] parts) -> Tensor");
  m.def("q5_1_int8_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q5_1_int16_dequantize(Tensor weight, Tensor(a!) out) -> ()");
  m.def("q4_0_int16_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q4_0_int16_pack(Tensor[] parts) -> Tensor");
  m.def("q4_0_int8_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("q4_0_int16_dequantize(Tensor weight, Tensor(a!) out) -> ()");
  m.def("iq4_nl_int16_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("iq4_nl_int16_pack(Tensor[] parts) -> Tensor");
  m.def("iq4_nl_int8_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("iq4_nl_int16_dequantize(Tensor weight, Tensor(a!) out) -> ()");
  m.def("mxfp4_int16_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("mxfp4_int16_pack(Tensor[] parts) -> Tensor");
  m.def("mxfp4_int8_linear(Tensor input, Tensor weight, int out_features, Tensor? bias) -> Tensor");
  m.def("mxfp4_int16_dequantize(Tensor weight, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(lmserve, CPU, m) {
  m.impl("q4_1_int16_linear", &linear<Q4_1>);
  m.impl("q4_1_int16_pack", &pack<Q4_1>);
  m.impl("q4_1_int8_linear", &linear<Q4_1, false>);
  m.impl("q4_1_int16_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<Q4_1>(w, out); });
  m.impl("q8_0_int16_linear", &linear<Q8_0>);
  m.impl("q8_0_int16_pack", &pack<Q8_0>);
  m.impl("q8_0_int8_linear", &linear<Q8_0, false>);
  m.impl("q8_0_int16_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<Q8_0>(w, out); });
  m.impl("q5_0_int16_linear", &linear<Q5_0>);
  m.impl("q5_0_int16_pack", &pack<Q5_0>);
  m.impl("q5_0_int8_linear", &linear<Q5_0, false>);
  m.impl("q5_0_int16_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<Q5_0>(w, out); });
  m.impl("q5_1_int16_linear", &linear<Q5_1>);
  m.impl("q5_1_int16_pack", &pack<Q5_1>);
  m.impl("q5_1_int8_linear", &linear<Q5_1, false>);
  m.impl("q5_1_int16_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<Q5_1>(w, out); });
  m.impl("q4_0_int16_linear", &linear<Q4_0>);
  m.impl("q4_0_int16_pack", &pack<Q4_0>);
  m.impl("q4_0_int8_linear", &linear<Q4_0, false>);
  m.impl("q4_0_int16_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<Q4_0>(w, out); });
  m.impl("iq4_nl_int16_linear", &linear<IQ4_NL>);
  m.impl("iq4_nl_int16_pack", &pack<IQ4_NL>);
  m.impl("iq4_nl_int8_linear", &linear<IQ4_NL, false>);
  m.impl("iq4_nl_int16_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<IQ4_NL>(w, out); });
  m.impl("mxfp4_int16_linear", &linear<MXFP4>);
  m.impl("mxfp4_int16_pack", &pack<MXFP4>);
  m.impl("mxfp4_int8_linear", &linear<MXFP4, false>);
  m.impl("mxfp4_int16_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<MXFP4>(w, out); });
}

#endif  // LMSERVE_INT16_KERNELS: AVX-512 VNNI, or AVX2 with FMA and F16C
