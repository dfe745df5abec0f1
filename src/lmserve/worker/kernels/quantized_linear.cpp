// Linear layers over llama.cpp's block-quantized weights with float32 activations: y = x @ W.T (+ bias).
//
// Decoding a small model on a CPU reads every weight once per step, so bytes per weight set the speed. Two of
// GGUF's block formats (32 weights of a row per block), with llama.cpp's values:
//   q4_1: a float16 scale d and minimum m, and 32 integers q in 0..15: w = d * q + m (0.625 bytes per weight).
//   q8_0: a float16 scale d and 32 int8 q: w = d * q (1.0625 bytes per weight).
// Their bytes are regrouped into panels of 8 output rows (as llama.cpp's own CPU repacks do): for each block of 32
// columns, a panel holds the 8 rows' d, then (q4_1) their m, then the quants column by column, 8 rows at a time:
//   q4_1: 16 + 16 + 128 bytes; the 8 bytes of column j hold row r's q[j] in the low and q[j + 16] in the high nibble.
//   q8_0: 16 + 256 bytes; the 8 bytes of column j hold row r's q[j].
// A column of a panel widens to one vector of 8 floats, one per output row, which is multiplied by one input value
// broadcast to all lanes: the 8 rows' outputs build up in one vector, and the scales of 8 rows widen with one
// instruction. Laid out row by row, the per-row work (scales widened one by one, a horizontal sum per row) took
// as long as the products on this model's 576-wide rows.
// The activations are never quantized (llama.cpp quantizes them to 8 bits; this model's MLP inputs carry outliers
// that int8 activations ruin, docs/benchmarks.md).
//
// Work is split over panels on torch's OpenMP threads. Batches above 8 rows widen a group of panels into float32
// first and run register tiles over it (gemm_product below).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

// AVX2 with FMA and F16C only; elsewhere the ops are not registered and lmserve keeps float16 weights.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <new>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPanel = 8;       // output rows per panel: one vector of float32
constexpr int kMaxTileRows = 8;     // input rows that share one pass over the weights

// 32-byte aligned storage, for aligned vector stores into a buffer.
template <class T>
struct Aligned32 {
  using value_type = T;
  Aligned32() = default;
  template <class U>
  Aligned32(const Aligned32<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(32))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(32)); }
  template <class U>
  bool operator==(const Aligned32<U>&) const { return true; }
};

inline __m256 widen_halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// step(quants, j, c0, c1): two of a block's 32 columns (8 rows each) as floats of the integers q; kColumn0(j) and
// kColumn1(j) say which. 16 steps cover a block.
struct Q4_1 {
  static constexpr int64_t kBytes = 20;  // per block of one row
  static constexpr int64_t kPanelBytes = 16 + 16 + 128;
  static constexpr int64_t kQuants = 32;  // offset of the quants in a panel's block
  static constexpr bool kMinimum = true;
  static constexpr int column0(int j) { return j; }
  static constexpr int column1(int j) { return j + 16; }
  static inline void step(const uint8_t* quants, int j, __m256& c0, __m256& c1) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(quants + 8 * j)));
    c0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
    c1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static constexpr int64_t kPanelBytes = 16 + 256;
  static constexpr int64_t kQuants = 16;
  static constexpr bool kMinimum = false;
  static constexpr int column0(int j) { return 2 * j; }
  static constexpr int column1(int j) { return 2 * j + 1; }
  static inline void step(const uint8_t* quants, int j, __m256& c0, __m256& c1) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants + 16 * j));
    c0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    c1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
  }
};

inline __m256 broadcast(const float* p) { return _mm256_broadcast_ss(p); }

// A thread reads its panels front to back, but the hardware prefetcher alone left one or two rows' decode waiting on
// memory: asking for the block kPrefetchAhead bytes ahead made 30 layers of one-row products 1.2-1.3x faster on a
// 2-core AVX-512 Xeon VM (benchmarks/block_kernel_ab.py; 2,048 or 8,192 bytes ahead gave the same, 512 about half
// the gain). Prefetching past the end of the weights is harmless (a prefetch never faults).
constexpr int64_t kPrefetchAhead = 4096;

template <class Format>
inline void prefetch_ahead(const uint8_t* block) {
  for (int64_t line = 0; line < Format::kPanelBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchAhead + line), _MM_HINT_T0);
}

// One panel against T ≤ 2 input rows. Per block and input row, the integers q are multiplied with the inputs
// (four independent chains) and the sum scaled by the panel's 8 d's once; the minimums join as m * (the input's block
// sum). That is one FMA per column and row, where widening q to weights first costs one more per column.
template <class Format, int T>
inline void panel_folded(const uint8_t* panel, int64_t blocks, const float* x, int64_t K, const float* sums,
                         __m256 out[T]) {
  // Separate accumulators for the scaled products and the minimums: one chain through both would add an FMA's latency
  // to every block.
  constexpr int kChains = 4;  // independent FMA chains per input row within a block
  __m256 acc[T], acc_minimum[T];
  for (int t = 0; t < T; ++t) acc[t] = acc_minimum[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, panel += Format::kPanelBytes) {
    prefetch_ahead<Format>(panel);
    const uint8_t* quants = panel + Format::kQuants;
    const float* xb = x + b * kBlock;
    __m256 p[T][kChains];
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < kChains; ++c) p[t][c] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < 16; j += kChains / 2) {
#pragma GCC unroll 8
      for (int u = 0; u < kChains / 2; ++u) {
        __m256 c0, c1;
        Format::step(quants, j + u, c0, c1);
        for (int t = 0; t < T; ++t) {
          const float* xt = xb + t * K;
          p[t][2 * u] = _mm256_fmadd_ps(c0, broadcast(xt + Format::column0(j + u)), p[t][2 * u]);
          p[t][2 * u + 1] = _mm256_fmadd_ps(c1, broadcast(xt + Format::column1(j + u)), p[t][2 * u + 1]);
        }
      }
    }
    const __m256 d = widen_halves(panel);
    for (int t = 0; t < T; ++t) {
      __m256 s = p[t][0];
      for (int c = 1; c < kChains; ++c) s = _mm256_add_ps(s, p[t][c]);
      acc[t] = _mm256_fmadd_ps(s, d, acc[t]);
    }
    if constexpr (Format::kMinimum) {
      const __m256 m = widen_halves(panel + 16);
      for (int t = 0; t < T; ++t) acc_minimum[t] = _mm256_fmadd_ps(m, broadcast(sums + t * blocks + b), acc_minimum[t]);
    }
  }
  for (int t = 0; t < T; ++t) out[t] = _mm256_add_ps(acc[t], acc_minimum[t]);
}

// One panel against 3 ≤ T ≤ 8 input rows: each column widened once to the 8 rows' weights (one FMA) and shared by
// the T rows (one FMA each), with two accumulators per row while there are registers for them.
template <class Format, int T>
inline void panel_widened(const uint8_t* panel, int64_t blocks, const float* x, int64_t K, const float*,
                          __m256 out[T]) {
  constexpr int S = T <= 4 ? 2 : 1;
  __m256 acc[T][S];
  for (int t = 0; t < T; ++t)
    for (int s = 0; s < S; ++s) acc[t][s] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, panel += Format::kPanelBytes) {
    prefetch_ahead<Format>(panel);
    const uint8_t* quants = panel + Format::kQuants;
    const float* xb = x + b * kBlock;
    const __m256 d = widen_halves(panel);
    const __m256 m = Format::kMinimum ? widen_halves(panel + 16) : _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      __m256 c0, c1;
      Format::step(quants, j, c0, c1);
      const __m256 w0 = Format::kMinimum ? _mm256_fmadd_ps(c0, d, m) : _mm256_mul_ps(c0, d);
      const __m256 w1 = Format::kMinimum ? _mm256_fmadd_ps(c1, d, m) : _mm256_mul_ps(c1, d);
      for (int t = 0; t < T; ++t) {
        acc[t][0] = _mm256_fmadd_ps(w0, broadcast(xb + t * K + Format::column0(j)), acc[t][0]);
        acc[t][S - 1] = _mm256_fmadd_ps(w1, broadcast(xb + t * K + Format::column1(j)), acc[t][S - 1]);
      }
    }
  }
  for (int t = 0; t < T; ++t) out[t] = S > 1 ? _mm256_add_ps(acc[t][0], acc[t][S - 1]) : acc[t][0];
}

// Panels [begin, end) against a tile of T input rows (x: [T, K], sums: [T, blocks]); y rows are N apart.
template <class Format, int T>
void panels_product(const uint8_t* weight, int64_t begin, int64_t end, int64_t K, const float* x, const float* sums,
                    const float* bias, float* y, int64_t N) {
  const int64_t blocks = K / kBlock;
  for (int64_t p = begin; p < end; ++p) {
    __m256 out[T];
    const uint8_t* panel = weight + p * blocks * Format::kPanelBytes;
    if constexpr (T <= 2) panel_folded<Format, T>(panel, blocks, x, K, sums, out);
    else panel_widened<Format, T>(panel, blocks, x, K, sums, out);
    const int64_t row = p * kPanel, rows = std::min<int64_t>(kPanel, N - row);
    for (int t = 0; t < T; ++t) {
      alignas(32) float values[kPanel];
      _mm256_store_ps(values, out[t]);
      float* dst = y + t * N + row;
      for (int64_t r = 0; r < rows; ++r) dst[r] = values[r] + (bias ? bias[row + r] : 0.0f);
    }
  }
}

template <class Format>
void tile_product(int T, const uint8_t* weight, int64_t begin, int64_t end, int64_t K, const float* x,
                  const float* sums, const float* bias, float* y, int64_t N) {
  switch (T) {
    case 1: panels_product<Format, 1>(weight, begin, end, K, x, sums, bias, y, N); break;
    case 2: panels_product<Format, 2>(weight, begin, end, K, x, sums, bias, y, N); break;
    case 3: panels_product<Format, 3>(weight, begin, end, K, x, sums, bias, y, N); break;
    case 4: panels_product<Format, 4>(weight, begin, end, K, x, sums, bias, y, N); break;
    case 5: panels_product<Format, 5>(weight, begin, end, K, x, sums, bias, y, N); break;
    case 6: panels_product<Format, 6>(weight, begin, end, K, x, sums, bias, y, N); break;
    case 7: panels_product<Format, 7>(weight, begin, end, K, x, sums, bias, y, N); break;
    default: panels_product<Format, 8>(weight, begin, end, K, x, sums, bias, y, N);
  }
}

inline int64_t num_panels(int64_t N) { return (N + kPanel - 1) / kPanel; }

// Batches of more than kMaxTileRows rows (many decodes, prefill chunks): the weights of a group of panels are widened
// once into a float32 buffer [K][24] and shared by every input row, in register tiles of kGemmRows input rows by
// kGemmPanels panels: 12 accumulators, three weight loads and four broadcasts per 12 FMAs (measured against 6 rows by
// 2 panels: 1.06x at 16 rows, 1.11x at 20). Widening once per kGemmChunk rows costs about one FMA per weight.
// Tried and slower: widening 128 or 256 columns at a time (to stay in L1), and chunks of 24 or 48 rows.
// With AVX-512 (32 vector registers of 16 floats) the tile is 8 input rows by 4 panels: 16 accumulators, two weight
// loads and eight broadcasts per 16 FMAs. Every output is still one float32 FMA chain over k in order, with the same
// widened weights, so its bits are those of the AVX2 tile.
#if defined(__AVX512F__)
constexpr int kGemmRows = 8;
constexpr int kGemmPanels = 4;
#else
constexpr int kGemmRows = 4;
constexpr int kGemmPanels = 3;
#endif
constexpr int64_t kGemmWidth = kGemmPanels * kPanel;  // output rows per tile
constexpr int64_t kGemmChunk = 96;                    // input rows per widening of a panel group

// Panels [first, first + count) of the weight for all K columns into out, laid out [K][kGemmWidth]; panels past
// count are zeros. Block by block, so that each 64-byte line of out is written whole.
template <class Format>
void widen_panels(const uint8_t* weight, int64_t first, int64_t count, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    float* dst = out + b * kBlock * kGemmWidth;
    for (int i = 0; i < kGemmPanels; ++i, dst += kPanel) {
      if (i >= count) {
        for (int k = 0; k < kBlock; ++k) _mm256_storeu_ps(dst + k * kGemmWidth, _mm256_setzero_ps());
        continue;
      }
      const uint8_t* panel = weight + ((first + i) * blocks + b) * Format::kPanelBytes;
      const __m256 d = widen_halves(panel);
      const __m256 m = Format::kMinimum ? widen_halves(panel + 16) : _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        __m256 c0, c1;
        Format::step(panel + Format::kQuants, j, c0, c1);
        _mm256_store_ps(dst + Format::column0(j) * kGemmWidth,
                        Format::kMinimum ? _mm256_fmadd_ps(c0, d, m) : _mm256_mul_ps(c0, d));
        _mm256_store_ps(dst + Format::column1(j) * kGemmWidth,
                        Format::kMinimum ? _mm256_fmadd_ps(c1, d, m) : _mm256_mul_ps(c1, d));
      }
    }
  }
}

// Named accumulators, not an array: with an array GCC kept a copy on the stack and stored to it after every FMA.
#define LMSERVE_GEMM_ROW(t)                                        \
  if constexpr (T > t) {                                           \
    const __m256 v = broadcast(x + t * K + k);                     \
    acc##t##0 = _mm256_fmadd_ps(w0, v, acc##t##0);                 \
    acc##t##1 = _mm256_fmadd_ps(w1, v, acc##t##1);                 \
    acc##t##2 = _mm256_fmadd_ps(w2, v, acc##t##2);                 \
  }
#define LMSERVE_GEMM_STORE(t)                                      \
  if constexpr (T > t) {                                           \
    _mm256_store_ps(tile[t], acc##t##0);                           \
    _mm256_store_ps(tile[t] + kPanel, acc##t##1);                  \
    _mm256_store_ps(tile[t] + 2 * kPanel, acc##t##2);              \
  }

// A tile's T rows ([T][kGemmWidth]) into y's columns [row, row + width), plus the bias.
inline void write_tile(const float* tile, int T, const float* bias, float* y, int64_t N, int64_t row, int64_t width) {
  for (int t = 0; t < T; ++t) {
    float* dst = y + t * N + row;
    for (int64_t r = 0; r < width; ++r) dst[r] = tile[t * kGemmWidth + r] + (bias ? bias[row + r] : 0.0f);
  }
}

#if defined(__AVX512F__)
#undef LMSERVE_GEMM_ROW
#undef LMSERVE_GEMM_STORE
#define LMSERVE_GEMM_ROW(t)                                        \
  if constexpr (T > t) {                                           \
    const __m512 v = _mm512_set1_ps(x[t * K + k]);                 \
    acc##t##0 = _mm512_fmadd_ps(w0, v, acc##t##0);                 \
    acc##t##1 = _mm512_fmadd_ps(w1, v, acc##t##1);                 \
  }
#define LMSERVE_GEMM_STORE(t)                                      \
  if constexpr (T > t) {                                           \
    _mm512_storeu_ps(tile[t], acc##t##0);                          \
    _mm512_storeu_ps(tile[t] + 16, acc##t##1);                     \
  }

template <int T>
void gemm_tile(const float* w, int64_t K, const float* x, const float* bias, float* y, int64_t N, int64_t row,
               int64_t width, const uint8_t* ahead, int64_t ahead_lines) {
  static_assert(T >= 1 && T <= kGemmRows && kGemmWidth == 32);
  __m512 acc00 = _mm512_setzero_ps(), acc01 = acc00, acc10 = acc00, acc11 = acc00, acc20 = acc00, acc21 = acc00,
         acc30 = acc00, acc31 = acc00, acc40 = acc00, acc41 = acc00, acc50 = acc00, acc51 = acc00, acc60 = acc00,
         acc61 = acc00, acc70 = acc00, acc71 = acc00;
  for (int64_t k4 = 0; k4 < K; k4 += 4) {
    if ((k4 >> 2) < ahead_lines) _mm_prefetch(reinterpret_cast<const char*>(ahead + (k4 >> 2) * 64), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int64_t k = k4; k < k4 + 4; ++k, w += kGemmWidth) {
      const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
      LMSERVE_GEMM_ROW(0) LMSERVE_GEMM_ROW(1) LMSERVE_GEMM_ROW(2) LMSERVE_GEMM_ROW(3)
      LMSERVE_GEMM_ROW(4) LMSERVE_GEMM_ROW(5) LMSERVE_GEMM_ROW(6) LMSERVE_GEMM_ROW(7)
    }
  }
  alignas(64) float tile[kGemmRows][kGemmWidth];
  LMSERVE_GEMM_STORE(0) LMSERVE_GEMM_STORE(1) LMSERVE_GEMM_STORE(2) LMSERVE_GEMM_STORE(3)
  LMSERVE_GEMM_STORE(4) LMSERVE_GEMM_STORE(5) LMSERVE_GEMM_STORE(6) LMSERVE_GEMM_STORE(7)
  write_tile(&tile[0][0], T, bias, y, N, row, width);
}
#undef LMSERVE_GEMM_ROW
#undef LMSERVE_GEMM_STORE

#else
// T input rows (x: [T, K]) against widened weights [K][kGemmWidth] into y's columns [row, row + width). Every 4
// steps it prefetches one line of [ahead, ahead + 64 * ahead_lines): the next group's packed weights, which otherwise
// arrive from memory while nothing else runs (without it, 1.14x slower at 16 rows).
template <int T>
void gemm_tile(const float* w, int64_t K, const float* x, const float* bias, float* y, int64_t N, int64_t row,
               int64_t width, const uint8_t* ahead, int64_t ahead_lines) {
  static_assert(T >= 1 && T <= kGemmRows);
  __m256 acc00 = _mm256_setzero_ps(), acc01 = acc00, acc02 = acc00, acc10 = acc00, acc11 = acc00, acc12 = acc00,
         acc20 = acc00, acc21 = acc00, acc22 = acc00, acc30 = acc00, acc31 = acc00, acc32 = acc00;
  for (int64_t k4 = 0; k4 < K; k4 += 4) {
    if ((k4 >> 2) < ahead_lines) _mm_prefetch(reinterpret_cast<const char*>(ahead + (k4 >> 2) * 64), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int64_t k = k4; k < k4 + 4; ++k, w += kGemmWidth) {
      const __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + kPanel), w2 = _mm256_load_ps(w + 2 * kPanel);
      LMSERVE_GEMM_ROW(0) LMSERVE_GEMM_ROW(1) LMSERVE_GEMM_ROW(2) LMSERVE_GEMM_ROW(3)
    }
  }
  alignas(32) float tile[kGemmRows][kGemmWidth];
  LMSERVE_GEMM_STORE(0) LMSERVE_GEMM_STORE(1) LMSERVE_GEMM_STORE(2) LMSERVE_GEMM_STORE(3)
  write_tile(&tile[0][0], T, bias, y, N, row, width);
}
#undef LMSERVE_GEMM_ROW
#undef LMSERVE_GEMM_STORE

#endif  // AVX-512

// A tile of `rows` (1 to kGemmRows) input rows: gemm_tile<rows>.
template <int T = kGemmRows>
void gemm_rows(int rows, const float* w, int64_t K, const float* x, const float* bias, float* y, int64_t N,
               int64_t row, int64_t width, const uint8_t* ahead, int64_t ahead_lines) {
  if constexpr (T > 1) {
    if (rows < T) return gemm_rows<T - 1>(rows, w, K, x, bias, y, N, row, width, ahead, ahead_lines);
  }
  gemm_tile<T>(w, K, x, bias, y, N, row, width, ahead, ahead_lines);
}

// x: [M, K] (M > kMaxTileRows) against the panel groups [begin, end) of kGemmPanels panels each.
template <class Format>
void gemm_product(const uint8_t* weight, int64_t begin, int64_t end, int64_t K, int64_t M, const float* x,
                  const float* bias, float* y, int64_t N) {
  const int64_t blocks = K / kBlock, panels = (N + kPanel - 1) / kPanel;
  std::vector<float, Aligned32<float>> widened(K * kGemmWidth);
  const int64_t group_bytes = kGemmPanels * blocks * Format::kPanelBytes;
  for (int64_t m0 = 0; m0 < M; m0 += kGemmChunk) {
    const int64_t rows = std::min(kGemmChunk, M - m0);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * kGemmPanels;
      widen_panels<Format>(weight, first, std::min<int64_t>(kGemmPanels, panels - first), blocks, widened.data());
      const int64_t row = first * kPanel, width = std::min(kGemmWidth, N - row);
      // The first tile prefetches the next group's weights (the groups of a thread's range are contiguous): up to K/4
      // lines, all of a q4_1 group and about 60% of a q8_0 one.
      const int64_t ahead_lines = g + 1 < end ? (std::min(group_bytes, (panels - first - kGemmPanels) * blocks *
                                                                           Format::kPanelBytes) + 63) / 64 : 0;
      for (int64_t t0 = 0; t0 < rows; t0 += kGemmRows)
        gemm_rows(static_cast<int>(std::min<int64_t>(kGemmRows, rows - t0)), widened.data(), K,
                  x + (m0 + t0) * K, bias, y + (m0 + t0) * N, N, row, width, weight + (first + kGemmPanels) * blocks *
                  Format::kPanelBytes, t0 == 0 ? ahead_lines : 0);
    }
  }
}

void check_inputs(const at::Tensor& weight, int64_t N, int64_t K, int64_t block_bytes) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "packed weight must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(K > 0 && K % kBlock == 0, "in_features must be a positive multiple of 32, got ", K);
  const int64_t expected = num_panels(N) * kPanel * (K / kBlock) * block_bytes;
  TORCH_CHECK(weight.numel() == expected, "packed weight has ", weight.numel(), " bytes, expected ", expected, " for ",
              N, " x ", K);
}

template <class Format>
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, int64_t out_features,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kFloat, "input must be float32 on CPU");
  const int64_t K = input.size(-1);
  const int64_t N = out_features;
  check_inputs(weight, N, K, Format::kBytes);
  const at::Tensor x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  const float* bias_data = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous float32 tensor of out_features");
    bias_data = bias->data_ptr<float>();
  }
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.view(out_shape);
  const int64_t blocks = K / kBlock;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (M > kMaxTileRows) {
    const int64_t groups = (num_panels(N) + kGemmPanels - 1) / kGemmPanels;
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      gemm_product<Format>(wp, begin, end, K, M, xp, bias_data, yp, N);
    });
    return y.view(out_shape);
  }
  // Each input row's block sums, for the minimums' share of the product.
  std::vector<float> sums(Format::kMinimum ? M * blocks : 0);
  for (size_t i = 0; i < sums.size(); ++i) {
    const float* src = xp + i * kBlock;
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(src), _mm256_loadu_ps(src + 8)),
                                   _mm256_add_ps(_mm256_loadu_ps(src + 16), _mm256_loadu_ps(src + 24)));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    sums[i] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
  at::parallel_for(0, num_panels(N), 4, [&](int64_t begin, int64_t end) {
    // Tiles of up to kMaxTileRows input rows, each over a stretch of panels that stays in L2 between tiles.
    constexpr int64_t kStretch = 64;
    for (int64_t p0 = begin; p0 < end; p0 += kStretch)
      for (int64_t t0 = 0; t0 < M; t0 += kMaxTileRows)
        tile_product<Format>(static_cast<int>(std::min<int64_t>(kMaxTileRows, M - t0)), wp, p0,
                             std::min(end, p0 + kStretch), K, xp + t0 * K, sums.data() + t0 * blocks, bias_data,
                             yp + t0 * N, N);
  });
  return y.view(out_shape);
}

// The float32 weight matrix [N, K] into out: the float16 copy for larger batches, and tests.
template <class Format>
void dequantize(const at::Tensor& weight, at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2, "out must be [N, K] float32");
  const int64_t N = out.size(0), K = out.size(1);
  check_inputs(weight, N, K, Format::kBytes);
  const int64_t blocks = K / kBlock;
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, num_panels(N), 4, [&](int64_t begin, int64_t end) {
    alignas(32) float columns[kBlock][kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t row = p * kPanel, rows = std::min<int64_t>(kPanel, N - row);
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* panel = wp + (p * blocks + b) * Format::kPanelBytes;
        const __m256 d = widen_halves(panel);
        const __m256 m = Format::kMinimum ? widen_halves(panel + 16) : _mm256_setzero_ps();
        for (int j = 0; j < 16; ++j) {
          __m256 c0, c1;
          Format::step(panel + Format::kQuants, j, c0, c1);
          _mm256_store_ps(columns[Format::column0(j)], Format::kMinimum ? _mm256_fmadd_ps(c0, d, m) : _mm256_mul_ps(c0, d));
          _mm256_store_ps(columns[Format::column1(j)], Format::kMinimum ? _mm256_fmadd_ps(c1, d, m) : _mm256_mul_ps(c1, d));
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < kBlock; ++k) op[(row + r) * K + b * kBlock + k] = columns[k][r];
      }
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
  m.impl("q4_1_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<Q4_1>(w, out); });
  m.impl("q8_0_dequantize", [](const at::Tensor& w, at::Tensor out) { dequantize<Q8_0>(w, out); });
}

#endif  // AVX2, FMA, F16C
