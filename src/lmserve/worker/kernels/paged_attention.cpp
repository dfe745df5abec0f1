// Causal attention that reads K/V from the paged block cache in place, for CPU and float32 queries: the kernel of
// builds that target AVX-512 (paged_attention.h says why there are two).
//
// Each request contributes `query_len` query rows that attend over its first `context_len` cached positions; query i
// sits at position context_len - query_len + i and sees keys up to and including its own position. The PyTorch path
// gathers every request's blocks into a padded copy first; this kernel walks the block table instead, so a request
// costs what its own context costs, and nothing is copied.
//
// Work is split over (request, tile of queries, and kv head when there are few requests) on torch's own intra-op
// thread pool (at::parallel_for), so it never starts a second pool that would fight torch's threads for the cores.
// Softmax is computed online, one cache block at a time. `write_kv_cache`, at the end, stores a step's new K/V.
//
// Layout: K blocks are [block, kv head, dim, key] (each kv head's keys of a block transposed), V blocks [block, kv
// head, key, dim]. With keys along a vector's lanes, a query's scores against a group of kLanes keys are one chain of
// fused multiply-adds over the dims (a broadcast query value times a row of K^T), with no horizontal sums; p . V then
// runs along V's dims. One kv head's part of a block is a contiguous run either way, which the next block's prefetch
// fetches while this block computes.
//
// Every query row is computed alone, in the same order of operations whatever shares its work item: its scores,
// maximum, exponentials and sums never mix with another row's. So a row's output is the same bits as a decode, in a
// chunk of 16 queries or of 500 (worker/attention.py sends every chunk here for it: a row's attention then does not
// depend on how its prompt was chunked or on what shared its step). Rows that share a kv head are computed together so that each K^T and V value is loaded once
// for several rows.

#include <torch/library.h>

#include "paged_attention.h"

#if defined(__AVX512F__) && defined(__F16C__)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace lmserve_paged;

constexpr int kLanes = 16;   // keys per score vector
constexpr int kPartials = 4; // independent chains of multiply-adds per score vector (summed at the end)
constexpr int kRunRows = 6;  // rows computed together: kRunRows x kPartials accumulators in registers

// The vectors: kLanes floats for scores, kLanes or 8 for p . V (a head size that is not a multiple of kLanes).
// aligned(4) lets a pointer cast load from any float address. Typedefs inside a struct, because one passed as a
// template argument (std::conditional) loses its aligned(4).
template <int kWidth>
struct Floats;
template <>
struct Floats<8> {
  typedef float type __attribute__((vector_size(32), aligned(4)));
};
template <>
struct Floats<16> {
  typedef float type __attribute__((vector_size(64), aligned(4)));
};
typedef Floats<kLanes>::type Vec;
typedef int32_t IntVec __attribute__((vector_size(4 * kLanes), aligned(4)));

// a * b + c rounded once. Written out because GCC's own contraction of a * b + c (-ffast-math) is not the same in
// every inlined copy: in a test, 22 of 96 scores of six rows computed together differed by an ulp from the same rows
// computed alone. With every product fused explicitly, a row's arithmetic is the same wherever it is computed.
inline Floats<8>::type fmadd(Floats<8>::type a, Floats<8>::type b, Floats<8>::type c) {
  return (Floats<8>::type)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
inline Floats<16>::type fmadd(Floats<16>::type a, Floats<16>::type b, Floats<16>::type c) {
  return (Floats<16>::type)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}

inline Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline void store(float* p, Vec v) { *reinterpret_cast<Vec*>(p) = v; }

inline Vec lane_indices() {
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(i);
  return v;
}

// e^x for x <= 0, lane by lane: the same polynomial in every lane, so a value's result never depends on the lane it
// sits in or on what the other lanes hold. Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-5 polynomial,
// times 2^n by adding n to the exponent bits. Below -87 (where e^x leaves float's normal range) it returns 0.
inline Vec exp_nonpositive(Vec x) {
  const IntVec underflows = x < -87.0f;
  x = underflows ? Vec{} - 87.0f : x;
  const Vec half = x < 0.0f ? Vec{} - 0.5f : Vec{} + 0.5f;  // truncating x log2(e) +- 1/2 rounds it to nearest
  const Vec n =
      __builtin_convertvector(__builtin_convertvector(fmadd(x, Vec{} + 1.44269504088896341f, half), IntVec), Vec);
  Vec r = fmadd(n, Vec{} - 0.693359375f, x);
  r = fmadd(n, Vec{} + 2.12194440e-4f, r);
  Vec p = Vec{} + 1.9875691500e-4f;
  p = fmadd(p, r, Vec{} + 1.3981999507e-3f);
  p = fmadd(p, r, Vec{} + 8.3334519073e-3f);
  p = fmadd(p, r, Vec{} + 4.1665795894e-2f);
  p = fmadd(p, r, Vec{} + 1.6666665459e-1f);
  p = fmadd(p, r, Vec{} + 5.0000001201e-1f);
  p = fmadd(p, r * r, r + 1.0f);
  const IntVec scaled = reinterpret_cast<IntVec>(p) + (__builtin_convertvector(n, IntVec) << 23);
  return reinterpret_cast<Vec>(underflows ? IntVec{} : scaled);
}

// A vector's sum (in one fixed order of halves) and maximum.
inline float sum_lanes(Vec v) { return _mm512_reduce_add_ps((__m512)v); }
inline float max_lanes(Vec v) { return _mm512_reduce_max_ps((__m512)v); }

// Cache values as float32 vectors: float32 caches as they are, float16 ones (`--kv-cache-dtype float16`, half the
// bytes to stream per step) widened with F16C, which is exact.
// (By width, not by vector type: a vector type passed as a template argument loses its aligned(4).)
template <int kWidth>
inline typename Floats<kWidth>::type load_as(const float* p) {
  return *reinterpret_cast<const typename Floats<kWidth>::type*>(p);
}
template <int kWidth>
inline typename Floats<kWidth>::type load_as(const at::Half* p) {
  using V = typename Floats<kWidth>::type;
  if constexpr (kWidth == 16)
    return (V)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  else
    return (V)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// n cache values into float32.
template <typename KV>
inline void widen(const KV* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) *reinterpret_cast<Floats<16>::type*>(dst + i) = load_as<16>(src + i);
  for (; i + 8 <= n; i += 8) *reinterpret_cast<Floats<8>::type*>(dst + i) = load_as<8>(src + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// One kv head's part of a cache block as float32, for a tile whose many rows then read it: K^T [kDim][padded] with
// keys past block_size zero, V [block_size][kDim].
template <int kDim, typename KV>
void widen_block(const KV* k, const KV* v, int64_t block_size, int64_t padded, float* kt, float* vs) {
  if (padded == block_size) {
    widen(k, kt, kDim * block_size);
  } else {
    for (int64_t d = 0; d < kDim; ++d) {
      widen(k + d * block_size, kt + d * padded, block_size);
      std::fill(kt + d * padded + block_size, kt + (d + 1) * padded, 0.f);
    }
  }
  widen(v, vs, kDim * block_size);
}

// One kv head's part of an int8 block (keys [0, keys), rows as V's: paged_attention.h) as widen_block leaves a float
// one: K^T [kDim][padded], zero past `keys`, and V [block_size][kDim].
template <int kDim>
void dequantize_block(const int8_t* k, const int8_t* v, int64_t keys, int64_t padded, float* kt, float* vs) {
  const int64_t width = int8_row_bytes(kDim);
  float key[kDim];
  for (int64_t j = 0; j < keys; ++j) {
    dequantize_row(k + j * width, key, kDim);
    for (int64_t d = 0; d < kDim; ++d) kt[d * padded + j] = key[d];
    dequantize_row(v + j * width, vs + j * kDim, kDim);
  }
  for (int64_t d = 0; d < kDim; ++d) std::fill(kt + d * padded + keys, kt + (d + 1) * padded, 0.f);
}

// One kv head's part of a block, where a run of rows reads it: K^T [kDim][stride] and V [block size][kDim], float32
// (widened) or the cache's own values. `next_k` / `next_v`: the same part of the next block, prefetched one 64-byte
// line at a time as this block's are read, so the requests never fill the core's miss buffers in one burst; null on
// the last block, and for all but the first run of rows.
template <typename T>
struct BlockPart {
  const T* kt;
  const T* v;
  int64_t stride;
  const T* next_k;
  const T* next_v;
};

// Scores of kRows rows (queries, [kRows][kDim], already scaled) against the block's keys: kPartials chains of
// multiply-adds over the dims per group of kLanes keys, summed pairwise. Keys at or past a row's `visible` count get
// the lowest float.
template <int kDim, int kRows, typename T>
void run_scores(const float* queries, const BlockPart<T>& part, int64_t padded, const int64_t* hidden,
                const int64_t* visible, float softcap, float* scores) {
  static_assert(kDim % kPartials == 0, "head sizes are multiples of 8");
  constexpr int64_t kLine = 64 / sizeof(T);
  const Vec lanes = lane_indices();
  for (int64_t g = 0; g < padded; g += kLanes) {
    Vec acc[kRows][kPartials] = {};
    for (int d = 0; d < kDim; d += kPartials) {
      if (part.next_k != nullptr && g == 0)
        for (int64_t f = d * part.stride; f < (d + kPartials) * part.stride; f += kLine)
          __builtin_prefetch(part.next_k + f, 0, 3);
      for (int p = 0; p < kPartials; ++p) {
        const Vec key = load_as<kLanes>(part.kt + (d + p) * part.stride + g);
        for (int r = 0; r < kRows; ++r) acc[r][p] = fmadd(Vec{} + queries[r * kDim + d + p], key, acc[r][p]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      Vec s;
      if constexpr (kPartials == 4)
        s = (acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]);
      else
        s = acc[r][0] + acc[r][1];
      const Vec limit = Vec{} + static_cast<float>(visible[r] - g), start = Vec{} + static_cast<float>(hidden[r] - g);
      store(scores + r * padded + g,
            lanes < limit && lanes >= start ? s : Vec{} + std::numeric_limits<float>::lowest());
    }
  }
  if (softcap > 0.f)  // Gemma 2's cap on every score: softcap * tanh(score / softcap)
    for (int r = 0; r < kRows; ++r)
      for (int64_t j = std::max<int64_t>(hidden[r], 0); j < visible[r]; ++j)
        scores[r * padded + j] = softcap * std::tanh(scores[r * padded + j] / softcap);
}

// acc += p . V over the first visible[r] keys of the block, for kRows rows, kSlice vectors of the dims at a time.
// Keys up to `least` are visible to every row.
template <int kDim, int kRows, typename T>
void run_values(const float* probs, int64_t padded, const BlockPart<T>& part, const int64_t* visible, int64_t least,
                int64_t most, float* acc) {
  constexpr int kWidth = kDim % kLanes == 0 ? kLanes : 8;
  using V = typename Floats<kWidth>::type;
  constexpr int kVecs = kDim / kWidth;
  constexpr int kSlice = kVecs < 4 ? kVecs : 4;
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int v0 = 0; v0 < kVecs; v0 += kSlice) {
    V a[kRows][kSlice];
    for (int r = 0; r < kRows; ++r)
      for (int v = 0; v < kSlice; ++v) a[r][v] = *reinterpret_cast<const V*>(acc + r * kDim + kWidth * (v0 + v));
    for (int64_t j = 0; j < most; ++j) {
      const T* row = part.v + j * kDim + kWidth * v0;
      if (part.next_v != nullptr && v0 == 0)
        for (int64_t f = 0; f < kDim; f += kLine) __builtin_prefetch(part.next_v + j * kDim + f, 0, 3);
      V value[kSlice];
      for (int v = 0; v < kSlice; ++v) value[v] = load_as<kWidth>(row + kWidth * v);
      if (j < least) {
        for (int r = 0; r < kRows; ++r)
          for (int v = 0; v < kSlice; ++v) a[r][v] = fmadd(V{} + probs[r * padded + j], value[v], a[r][v]);
      } else {
        for (int r = 0; r < kRows; ++r)
          if (j < visible[r])
            for (int v = 0; v < kSlice; ++v) a[r][v] = fmadd(V{} + probs[r * padded + j], value[v], a[r][v]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int v = 0; v < kSlice; ++v) *reinterpret_cast<V*>(acc + r * kDim + kWidth * (v0 + v)) = a[r][v];
  }
  if (part.next_v != nullptr)
    for (int64_t j = most; j < part.stride; ++j)  // keys these rows do not see yet (causal)
      for (int64_t f = 0; f < kDim; f += kLine) __builtin_prefetch(part.next_v + j * kDim + f, 0, 3);
}

// kRows rows against one block: scores, the online softmax's update of each row's maximum and sum (rows that see
// none of the block's keys are left as they are), then p . V. A row sees keys [hidden, visible) of the block; run()
// sets visible to 0 where a sliding window hides all of them.
template <int kDim, int kRows, typename T>
void run_block(const float* queries, float* acc, float* scores, float* row_max, float* row_sum,
               const int64_t* hidden, const int64_t* visible, const BlockPart<T>& part, int64_t padded,
               float softcap) {
  run_scores<kDim, kRows, T>(queries, part, padded, hidden, visible, softcap, scores);
  const Vec lanes = lane_indices();
  int64_t least = padded, most = 0;
  for (int r = 0; r < kRows; ++r) {
    const int64_t n = visible[r];
    least = std::min(least, std::max<int64_t>(n, 0));
    if (n <= 0) continue;
    most = std::max(most, n);
    float* s = scores + r * padded;
    Vec top = load(s);
    for (int64_t g = kLanes; g < padded; g += kLanes) top = top > load(s + g) ? top : load(s + g);
    const float block_max = max_lanes(top);
    if (block_max > row_max[r]) {
      // exp(lowest - max) = 0 on the row's first block
      const float rescale = exp_nonpositive(Vec{} + (row_max[r] - block_max))[0];
      row_sum[r] *= rescale;
      for (int d = 0; d < kDim; ++d) acc[r * kDim + d] *= rescale;
      row_max[r] = block_max;
    }
    const Vec m = Vec{} + row_max[r];
    float sum = 0.f;
    for (int64_t g = 0; g < padded; g += kLanes) {
      const Vec p = exp_nonpositive(load(s + g) - m);
      const Vec visible_p =
          lanes < Vec{} + static_cast<float>(n - g) && lanes >= Vec{} + static_cast<float>(hidden[r] - g) ? p : Vec{};
      store(s + g, visible_p);
      sum += sum_lanes(visible_p);
    }
    row_sum[r] += sum;
  }
  if (most > 0) run_values<kDim, kRows, T>(scores, padded, part, visible, least, most, acc);
}

// `rows` rows that share one kv head against one block, kRunRows at a time.
template <int kDim, typename T>
void run_rows(int64_t rows, const float* queries, float* acc, float* scores, float* row_max, float* row_sum,
              const int64_t* hidden, const int64_t* visible, BlockPart<T> part, int64_t padded, float cap) {
  for (int64_t i = 0; i < rows; i += kRunRows) {
    const int64_t *h = hidden + i, *n = visible + i;
    const float* q = queries + i * kDim;
    float *a = acc + i * kDim, *s = scores + i * padded;
    switch (std::min<int64_t>(kRunRows, rows - i)) {
      case 1: run_block<kDim, 1, T>(q, a, s, row_max + i, row_sum + i, h, n, part, padded, cap); break;
      case 2: run_block<kDim, 2, T>(q, a, s, row_max + i, row_sum + i, h, n, part, padded, cap); break;
      case 3: run_block<kDim, 3, T>(q, a, s, row_max + i, row_sum + i, h, n, part, padded, cap); break;
      case 4: run_block<kDim, 4, T>(q, a, s, row_max + i, row_sum + i, h, n, part, padded, cap); break;
      case 5: run_block<kDim, 5, T>(q, a, s, row_max + i, row_sum + i, h, n, part, padded, cap); break;
      default: run_block<kDim, 6, T>(q, a, s, row_max + i, row_sum + i, h, n, part, padded, cap); break;
    }
    part.next_k = part.next_v = nullptr;  // the first run prefetched them
  }
}

template <int kDim, typename KV>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& requests, const std::vector<WorkItem>& items,
         int64_t group, double scale, int64_t window, float softcap, const float* sinks) {
  constexpr bool kInt8 = std::is_same_v<KV, int8_t>;
  const int64_t block_size = v_cache.size(2), num_kv_heads = v_cache.size(1), max_blocks = block_tables.size(1);
  const int64_t padded = (block_size + kLanes - 1) / kLanes * kLanes;
  const int64_t* req = requests.data_ptr<int64_t>();
  const float* q_data = q.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const KV* k_data = k_cache.data_ptr<KV>();
  const KV* v_data = v_cache.data_ptr<KV>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const int64_t head_values = block_size * (kInt8 ? int8_row_bytes(kDim) : kDim);
  const int64_t block_stride = num_kv_heads * head_values;
  const float fscale = static_cast<float>(scale);

  const std::vector<int64_t> bounds = thread_bounds(items, requests);
  const int64_t threads = bounds.size() - 1;
  at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t last_thread) {
    const int64_t begin = bounds[first_thread], end = bounds[last_thread];
    const int64_t max_rows = kQueryTile * q.size(1);
    std::vector<float> queries(max_rows * kDim), acc(max_rows * kDim), scores(max_rows * padded);
    std::vector<float> kt(kDim * padded), vs(block_size * kDim);
    std::vector<float> row_max(max_rows), row_sum(max_rows);
    std::vector<int64_t> row_position(max_rows), row_query(max_rows), row_head(max_rows), visible(max_rows);
    std::vector<int64_t> hidden(max_rows);
    for (int64_t w = begin; w < end; ++w) {
      const WorkItem& it = items[w];
      const int64_t first_row = req[3 * it.request], query_len = req[3 * it.request + 1];
      const int64_t context_len = req[3 * it.request + 2];
      const int64_t rows = it.num_queries * it.num_heads;
      // Rows kv head by kv head, then query by query, then head within the kv head's group: each kv head's rows
      // are one contiguous range.
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t in_group = i % group, query = (i / group) % it.num_queries, kv = i / (group * it.num_queries);
        const int64_t head = it.first_head + kv * group + in_group;
        const float* src = q_data + (first_row + it.first_query + query) * q_row + head * q_head;
        for (int64_t d = 0; d < kDim; ++d) queries[i * kDim + d] = src[d] * fscale;
        row_query[i] = it.first_query + query;
        row_position[i] = context_len - query_len + row_query[i];
        row_head[i] = head;
        row_max[i] = std::numeric_limits<float>::lowest();
        row_sum[i] = 0.f;
      }
      std::fill(acc.begin(), acc.begin() + rows * kDim, 0.f);
      const int64_t keys_needed = context_len - query_len + it.first_query + it.num_queries;
      const int64_t rows_per_kv = group * it.num_queries;
      const int64_t first_kv = it.first_head / group, num_kv = it.num_heads / group;
      const int32_t* table = tables + it.request * max_blocks;
      const int64_t first_position = context_len - query_len + it.first_query;
      for (int64_t b = first_window_key(first_position, window) / block_size; b * block_size < keys_needed; ++b) {
        const int64_t block_first = b * block_size;
        const int64_t block_keys = std::min(block_size, keys_needed - block_first);
        // Keys past a query's own position are masked out (causal), and under a sliding window the keys before it;
        // its own key is always visible.
        for (int64_t i = 0; i < rows; ++i) {
          visible[i] = std::min(block_keys, row_position[i] - block_first + 1);
          hidden[i] = std::clamp<int64_t>(first_window_key(row_position[i], window) - block_first, 0, block_size);
          if (hidden[i] >= visible[i]) visible[i] = 0;
        }
        const bool has_next = block_first + block_size < keys_needed;
        for (int64_t kv = 0; kv < num_kv; ++kv) {
          const int64_t offset = table[b] * block_stride + (first_kv + kv) * head_values;
          const int64_t next = has_next ? table[b + 1] * block_stride + (first_kv + kv) * head_values : -1;
          const int64_t r0 = kv * rows_per_kv;
          float *q = queries.data() + r0 * kDim, *a = acc.data() + r0 * kDim, *s = scores.data() + r0 * padded;
          // Rows for more than one run read the block widened once; a single run reads the cache; an int8 block is
          // always dequantized first.
          if (kInt8 || rows_per_kv > kRunRows || padded != block_size) {
            if constexpr (kInt8)
              dequantize_block<kDim>(k_data + offset, v_data + offset, block_keys, padded, kt.data(), vs.data());
            else
              widen_block<kDim, KV>(k_data + offset, v_data + offset, block_size, padded, kt.data(), vs.data());
            if (has_next)
              for (int64_t i = 0; i < head_values; i += 64 / static_cast<int64_t>(sizeof(KV))) {
                __builtin_prefetch(k_data + next + i, 0, 3);
                __builtin_prefetch(v_data + next + i, 0, 3);
              }
            const BlockPart<float> part{kt.data(), vs.data(), padded, nullptr, nullptr};
            run_rows<kDim, float>(rows_per_kv, q, a, s, row_max.data() + r0, row_sum.data() + r0,
                                  hidden.data() + r0, visible.data() + r0, part, padded, softcap);
          } else if constexpr (!kInt8) {
            const BlockPart<KV> part{k_data + offset, v_data + offset, block_size,
                                     has_next ? k_data + next : nullptr, has_next ? v_data + next : nullptr};
            run_rows<kDim, KV>(rows_per_kv, q, a, s, row_max.data() + r0, row_sum.data() + r0,
                               hidden.data() + r0, visible.data() + r0, part, padded, softcap);
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        float* dst = out_data + (first_row + row_query[i]) * o_row + row_head[i] * o_head;
        const float inv = output_scale(row_max[i], row_sum[i], sinks, row_head[i]);
        for (int64_t d = 0; d < kDim; ++d) dst[d] = acc[i * kDim + d] * inv;
      }
    }
  });
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& requests,
                     double scale, int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  check_attention_inputs(out, q, k_cache, v_cache, block_tables, requests, window, softcap);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = v_cache.size(2), num_kv_heads = v_cache.size(1);
  if (k_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(v_cache.size(3) == int8_row_bytes(head_dim) && num_heads % num_kv_heads == 0 &&
                    k_cache.sizes() == v_cache.sizes(),
                "paged_attention: int8 caches must both be [blocks, kv heads, block size, ", int8_row_bytes(head_dim),
                "] with head dim ", head_dim, " and a kv head count that divides ", num_heads, " query heads");
  } else {
    TORCH_CHECK(v_cache.size(3) == head_dim && num_heads % num_kv_heads == 0 && k_cache.size(0) == v_cache.size(0) &&
                    k_cache.size(1) == num_kv_heads && k_cache.size(2) == head_dim && k_cache.size(3) == block_size,
                "paged_attention: caches must be K [blocks, kv heads, head dim, block size] and V [blocks, kv heads, "
                "block size, head dim] with head dim ", head_dim, " and a kv head count that divides ", num_heads,
                " query heads");
  }
  const int64_t group = num_heads / num_kv_heads;
  const std::vector<WorkItem> items = plan_work(requests, num_heads, group, block_size, block_tables.size(1));
  dispatch_head_dim(head_dim, k_cache.scalar_type(), [&]<int kDim, typename KV>() {
    run<kDim, KV>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale, window,
                  static_cast<float>(softcap), sink_logits(sinks, num_heads));
  });
}

// One new position's K row of one kv head into its column of the block's K^T: value d lands block_size apart.
template <typename KV>
inline void store_column(KV* dst, const float* src, int64_t dim, int64_t block_size) {
  for (int64_t d = 0; d < dim; ++d) dst[d * block_size] = static_cast<KV>(src[d]);
}

template <typename KV>
void write_rows(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                const int64_t* rows) {
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2), block_size = v_cache.size(2);
  KV* k_dst = k_cache.data_ptr<KV>();
  KV* v_dst = v_cache.data_ptr<KV>();
  const float* k_src = k.data_ptr<float>();
  const float* v_src = v.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 4096 / (heads * dim));  // wake the other threads for prefill only
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t row = rows[t * heads + h], key = row % block_size;
        store_column(k_dst + (row - key) * dim + key, k_src + t * k.stride(0) + h * k.stride(1), dim, block_size);
        store_row(v_dst + row * dim, v_src + t * v.stride(0) + h * v.stride(1), dim);
      }
  });
}

// The step's new K and V into the cache: token t's kv head h goes to row rows[t * heads + h] of the V cache viewed as
// [blocks * kv heads * block size, head dim] (AttentionMetadata.cache_rows), and to the same key's column of the K
// cache's transposed blocks, converted to the cache's type. One op per layer where PyTorch took two conversions and
// two index_copy_ calls.
void write_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& rows) {
  check_write_inputs(k_cache, v_cache, k, v, rows);
  if (k_cache.scalar_type() == at::kChar) return write_int8_rows(k_cache, v_cache, k, v, rows.data_ptr<int64_t>());
  TORCH_CHECK(k_cache.sizes() == at::IntArrayRef({v_cache.size(0), v_cache.size(1), v_cache.size(3), v_cache.size(2)}),
              "write_kv_cache: caches must be K [blocks, kv heads, head dim, block size] and V [blocks, kv heads, "
              "block size, head dim] matching K and V");
  if (k_cache.scalar_type() == at::kHalf) return write_rows<at::Half>(k_cache, v_cache, k, v, rows.data_ptr<int64_t>());
  write_rows<float>(k_cache, v_cache, k, v, rows.data_ptr<int64_t>());
}

}  // namespace

TORCH_LIBRARY_IMPL(lmserve, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_cache", &write_kv_cache);
}

#endif  // __AVX512F__ && __F16C__

// The ops' schemas, whichever kernel the build holds.
namespace {
bool paged_keys_transposed() { return lmserve_paged::kKeysTransposed; }
}  // namespace

TORCH_LIBRARY(lmserve, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor requests, float scale, int window=0, float softcap=0., Tensor? sinks=None) -> ()");
  m.def("write_kv_cache(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor rows) -> ()");
  m.def("paged_keys_transposed() -> bool", &paged_keys_transposed);
}
