// Causal attention that reads K/V from the paged block cache in place, for CPU and float32 queries: the kernel of
// builds that do not target AVX-512, AVX2 ones first (paged_attention.h says why there are two).
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
// K and V blocks are both laid out [block, kv head, key, dim]: one kv head's part of a block is a single contiguous run of
// block_size x head_dim values, which the next block's prefetch can fetch line by line while this block computes.
// Token-major blocks ([block, key, kv head, dim]) made every head read strided slices; with them the attention of 16
// decodes ran 1.4x slower (benchmarks/kv_layout.py).

#include <torch/library.h>

#include "paged_attention.h"

#if !(defined(__AVX512F__) && defined(__F16C__))

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using namespace lmserve_paged;

// Eight floats in one AVX register; aligned(4) lets a pointer cast load from any float address.
typedef float Vec8 __attribute__((vector_size(32), aligned(4)));

inline Vec8 load(const float* p) { return *reinterpret_cast<const Vec8*>(p); }

// a * b + c, rounded once where the CPU has FMA. Written out because GCC's own contraction of a * b + c
// (-ffast-math) is not the same in every inlined copy: a float16 cache's copy of the kernel then rounded differently
// from the float32 one on the same values.
inline Vec8 fmadd(Vec8 a, Vec8 b, Vec8 c) {
#if defined(__FMA__)
  return (Vec8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
inline void store(float* p, Vec8 v) { *reinterpret_cast<Vec8*>(p) = v; }

// Eight cached K or V values as floats: float32 caches as they are, float16 ones (`--kv-cache-dtype float16`, half
// the bytes to stream per step) widened with F16C.
inline Vec8 load_kv(const float* p) { return load(p); }
#if defined(__F16C__)
inline Vec8 load_kv(const at::Half* p) {
  return reinterpret_cast<Vec8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

inline float horizontal_sum(Vec8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// A run of kRows rows that share one query position and one kv head (heads of a GQA group) against one cache block,
// with online softmax. Each key and value row is loaded once for the whole run, and the rows' sums are independent
// chains the CPU overlaps. kDim (the head size) is fixed at compile time so the loops unroll into registers.
// `k_block`/`v_block` are the head's [block_size, kDim] runs. When `next_k` is set, the run also prefetches the same
// head's part of the next block, one key row per key it computes: spread out like this the requests never fill the
// core's miss buffers, where a burst of a whole block's prefetches at once stalled the loads of the block in hand.
// Keys before j0 (outside a sliding window) are skipped; softcap > 0 caps each score at +-softcap (Gemma 2).
template <int kDim, int kRows, typename KV>
void run_block(const float* queries, float* acc, float* s, float* row_max, float* row_sum, int64_t j0, int64_t n,
               const KV* k_block, const KV* v_block, const KV* next_k, const KV* next_v, int64_t block_size,
               float softcap) {
  constexpr int kVecs = kDim / 8;
  auto prefetch_key = [&](int64_t j) {
    for (int f = 0; f < kDim; f += 64 / static_cast<int>(sizeof(KV))) {  // one 64-byte line at a time
      __builtin_prefetch(next_k + j * kDim + f, 0, 3);
      __builtin_prefetch(next_v + j * kDim + f, 0, 3);
    }
  };
  float block_max[kRows];
  for (int r = 0; r < kRows; ++r) block_max[r] = std::numeric_limits<float>::lowest();
  if (next_k != nullptr)
    for (int64_t j = 0; j < j0; ++j) prefetch_key(j);
  for (int64_t j = j0; j < n; ++j) {
    const KV* k = k_block + j * kDim;
    if (next_k != nullptr) prefetch_key(j);
    Vec8 dot[kRows] = {};
    for (int v = 0; v < kVecs; ++v) {
      const Vec8 kv = load_kv(k + 8 * v);
      for (int r = 0; r < kRows; ++r) dot[r] = fmadd(load(queries + r * kDim + 8 * v), kv, dot[r]);
    }
    for (int r = 0; r < kRows; ++r) {
      const float score = horizontal_sum(dot[r]);
      s[r * block_size + j] = softcap > 0.f ? softcap * std::tanh(score / softcap) : score;
      block_max[r] = std::max(block_max[r], s[r * block_size + j]);
    }
  }
  if (next_k != nullptr)
    for (int64_t j = n; j < block_size; ++j) prefetch_key(j);  // keys this row does not see yet (causal)
  for (int r = 0; r < kRows; ++r) {
    if (block_max[r] > row_max[r]) {
      const float rescale = std::exp(row_max[r] - block_max[r]);  // exp(lowest - max) = 0 on the first block
      row_sum[r] *= rescale;
      for (int d = 0; d < kDim; ++d) acc[r * kDim + d] *= rescale;
      row_max[r] = block_max[r];
    }
    float* p = s + r * block_size;
    const float m = row_max[r];
    float sum = 0.f;
    for (int64_t j = j0; j < n; ++j) {
      p[j] = std::exp(p[j] - m);
      sum += p[j];
    }
    row_sum[r] += sum;
  }
  // acc += p . V, a slice of at most four vectors per row at a time so that kRows accumulators fit the registers.
  constexpr int kSlice = kVecs < 4 ? kVecs : 4;
  for (int v0 = 0; v0 < kVecs; v0 += kSlice) {
    Vec8 a[kRows][kSlice];
    for (int r = 0; r < kRows; ++r)
      for (int v = 0; v < kSlice; ++v) a[r][v] = load(acc + r * kDim + 8 * (v0 + v));
    for (int64_t j = j0; j < n; ++j) {
      const KV* vrow = v_block + j * kDim + 8 * v0;
      for (int v = 0; v < kSlice; ++v) {
        const Vec8 vv = load_kv(vrow + 8 * v);
        for (int r = 0; r < kRows; ++r) a[r][v] = fmadd(Vec8{} + s[r * block_size + j], vv, a[r][v]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int v = 0; v < kSlice; ++v) store(acc + r * kDim + 8 * (v0 + v), a[r][v]);
  }
}

// All of a tile's rows against one cache block. Rows come in runs of up to four that share a query and a kv head;
// they are ordered query by query, `heads` rows each. The first query's runs prefetch the next block (`next_k` and
// `next_v`, null on the last block), one kv head each.
template <int kDim, typename KV>
void tile_block(int64_t rows, int64_t heads, int64_t group, const float* queries, float* acc, float* scores,
                float* row_max, float* row_sum, const int64_t* hidden, const int64_t* visible,
                const int64_t* kv_offset, const KV* k_block, const KV* v_block, const KV* next_k, const KV* next_v,
                int64_t block_size, float cap) {
  for (int64_t i = 0; i < rows;) {
    const int64_t in_group = i % group;
    const int64_t count = std::min<int64_t>(4, group - in_group);
    const int64_t j0 = hidden[i], n = visible[i];  // a run's rows share one query, so one window
    if (n > j0) {
      const KV *k = k_block + kv_offset[i], *v = v_block + kv_offset[i];
      const bool prefetches = next_k != nullptr && i < heads && in_group == 0;
      const KV* nk = prefetches ? next_k + kv_offset[i] : nullptr;
      const KV* nv = prefetches ? next_v + kv_offset[i] : nullptr;
      float *q = const_cast<float*>(queries) + i * kDim, *a = acc + i * kDim, *s = scores + i * block_size;
      switch (count) {
        case 1: run_block<kDim, 1, KV>(q, a, s, row_max + i, row_sum + i, j0, n, k, v, nk, nv, block_size, cap); break;
        case 2: run_block<kDim, 2, KV>(q, a, s, row_max + i, row_sum + i, j0, n, k, v, nk, nv, block_size, cap); break;
        case 3: run_block<kDim, 3, KV>(q, a, s, row_max + i, row_sum + i, j0, n, k, v, nk, nv, block_size, cap); break;
        default: run_block<kDim, 4, KV>(q, a, s, row_max + i, row_sum + i, j0, n, k, v, nk, nv, block_size, cap);
      }
    }
    i += count;
  }
}

// The kv heads [first, first + count) of an int8 block's keys [0, keys) as float32, into `k` and `v` laid out as a
// float cache's block ([kv head, key, kDim]), so that tile_block's offsets hold; the same heads of the next block
// (`next`, null on the last) are prefetched meanwhile, one 64-byte line at a time.
template <int kDim>
void dequantize_block(const int8_t* k_block, const int8_t* v_block, const int8_t* next_k, const int8_t* next_v,
                      int64_t first, int64_t count, int64_t keys, int64_t block_size, float* k, float* v) {
  const int64_t width = int8_row_bytes(kDim);
  for (int64_t h = first; h < first + count; ++h) {
    const int64_t part = h * block_size * width;
    for (int64_t j = 0; j < keys; ++j) {
      dequantize_row(k_block + part + j * width, k + (h * block_size + j) * kDim, kDim);
      dequantize_row(v_block + part + j * width, v + (h * block_size + j) * kDim, kDim);
    }
    if (next_k != nullptr)
      for (int64_t i = 0; i < block_size * width; i += 64) {
        __builtin_prefetch(next_k + part + i, 0, 3);
        __builtin_prefetch(next_v + part + i, 0, 3);
      }
  }
}

template <int kDim, typename KV>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& requests, const std::vector<WorkItem>& items,
         int64_t group, double scale, int64_t window, float softcap, const float* sinks) {
  constexpr bool kInt8 = std::is_same_v<KV, int8_t>;
  const int64_t block_size = k_cache.size(2), num_kv_heads = k_cache.size(1), max_blocks = block_tables.size(1);
  const int64_t* req = requests.data_ptr<int64_t>();
  const float* q_data = q.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const KV* k_data = k_cache.data_ptr<KV>();
  const KV* v_data = v_cache.data_ptr<KV>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const int64_t block_stride = num_kv_heads * block_size * (kInt8 ? int8_row_bytes(kDim) : kDim);
  const float fscale = static_cast<float>(scale);

  const std::vector<int64_t> bounds = thread_bounds(items, requests);
  const int64_t threads = bounds.size() - 1;
  at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t last_thread) {
    const int64_t begin = bounds[first_thread], end = bounds[last_thread];
    const int64_t max_rows = kQueryTile * q.size(1);
    std::vector<float> queries(max_rows * kDim), acc(max_rows * kDim), scores(max_rows * block_size);
    std::vector<float> row_max(max_rows), row_sum(max_rows);
    std::vector<int64_t> row_position(max_rows), row_head(max_rows), kv_offset(max_rows), visible(max_rows);
    std::vector<int64_t> hidden(max_rows);
    // int8: the block in hand as float32, [kv head, key, kDim] (paged_attention.h)
    std::vector<float> k_tile(kInt8 ? num_kv_heads * block_size * kDim : 0), v_tile(k_tile.size());
    for (int64_t w = begin; w < end; ++w) {
      const WorkItem& it = items[w];
      const int64_t first_row = req[3 * it.request], query_len = req[3 * it.request + 1];
      const int64_t context_len = req[3 * it.request + 2];
      const int64_t rows = it.num_queries * it.num_heads;
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t query = it.first_query + i / it.num_heads, head = it.first_head + i % it.num_heads;
        const float* src = q_data + (first_row + query) * q_row + head * q_head;
        for (int64_t d = 0; d < kDim; ++d) queries[i * kDim + d] = src[d] * fscale;
        row_position[i] = context_len - query_len + query;
        row_head[i] = head;
        kv_offset[i] = head / group * block_size * kDim;
        row_max[i] = std::numeric_limits<float>::lowest();
        row_sum[i] = 0.f;
      }
      std::fill(acc.begin(), acc.begin() + rows * kDim, 0.f);
      const int64_t keys_needed = row_position[rows - 1] + 1;
      const int32_t* table = tables + it.request * max_blocks;
      for (int64_t b = first_window_key(row_position[0], window) / block_size; b * block_size < keys_needed; ++b) {
        const int64_t block_first = b * block_size;
        const int64_t block_keys = std::min(block_size, keys_needed - block_first);
        // Keys past a query's own position are masked out (causal), and under a sliding window the keys before it;
        // its own key is always visible.
        for (int64_t i = 0; i < rows; ++i) {
          visible[i] = std::min(block_keys, row_position[i] - block_first + 1);
          hidden[i] = std::clamp<int64_t>(first_window_key(row_position[i], window) - block_first, 0, block_size);
        }
        const bool has_next = block_first + block_size < keys_needed;
        const KV* next_k = has_next ? k_data + table[b + 1] * block_stride : nullptr;
        const KV* next_v = has_next ? v_data + table[b + 1] * block_stride : nullptr;
        if constexpr (kInt8) {
          const int64_t first_kv = it.first_head / group, num_kv = (it.num_heads + group - 1) / group;
          dequantize_block<kDim>(k_data + table[b] * block_stride, v_data + table[b] * block_stride, next_k, next_v,
                                 first_kv, num_kv, block_keys, block_size, k_tile.data(), v_tile.data());
          tile_block<kDim, float>(rows, it.num_heads, group, queries.data(), acc.data(), scores.data(),
                                  row_max.data(), row_sum.data(), hidden.data(), visible.data(), kv_offset.data(),
                                  k_tile.data(), v_tile.data(), nullptr, nullptr, block_size, softcap);
        } else {
          tile_block<kDim, KV>(rows, it.num_heads, group, queries.data(), acc.data(), scores.data(), row_max.data(),
                               row_sum.data(), hidden.data(), visible.data(), kv_offset.data(),
                               k_data + table[b] * block_stride, v_data + table[b] * block_stride, next_k, next_v,
                               block_size, softcap);
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t query = it.first_query + i / it.num_heads;
        float* dst = out_data + (first_row + query) * o_row + row_head[i] * o_head;
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
  const int64_t block_size = k_cache.size(2), num_kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == cache_row_width(k_cache.scalar_type(), head_dim) && num_heads % num_kv_heads == 0 &&
                  v_cache.sizes() == k_cache.sizes(),
              "paged_attention: caches must be K and V [blocks, kv heads, block size, head dim] with head dim ",
              head_dim, " (an int8 row's bytes for an int8 cache) and a kv head count that divides ", num_heads,
              " query heads");
  const int64_t group = num_heads / num_kv_heads;
  const std::vector<WorkItem> items = plan_work(requests, num_heads, group, block_size, block_tables.size(1));
  dispatch_head_dim(head_dim, k_cache.scalar_type(), [&]<int kDim, typename KV>() {
    run<kDim, KV>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale, window,
                  static_cast<float>(softcap), sink_logits(sinks, num_heads));
  });
}

template <typename KV>
void write_rows(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                const int64_t* rows) {
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2);
  KV* k_dst = k_cache.data_ptr<KV>();
  KV* v_dst = v_cache.data_ptr<KV>();
  const float* k_src = k.data_ptr<float>();
  const float* v_src = v.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 4096 / (heads * dim));  // wake the other threads for prefill only
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t row = rows[t * heads + h];
        store_row(k_dst + row * dim, k_src + t * k.stride(0) + h * k.stride(1), dim);
        store_row(v_dst + row * dim, v_src + t * v.stride(0) + h * v.stride(1), dim);
      }
  });
}

// The step's new K and V into the cache: token t's kv head h goes to row rows[t * heads + h] of each cache viewed as
// [blocks * kv heads * block size, head dim] (AttentionMetadata.cache_rows), converted to the cache's type. One op
// per layer where PyTorch took two conversions and two index_copy_ calls.
void write_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& rows) {
  check_write_inputs(k_cache, v_cache, k, v, rows);
  if (k_cache.scalar_type() == at::kChar) return write_int8_rows(k_cache, v_cache, k, v, rows.data_ptr<int64_t>());
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(),
              "write_kv_cache: caches must be K and V [blocks, kv heads, block size, head dim] matching K and V");
  if (k_cache.scalar_type() == at::kHalf) return write_rows<at::Half>(k_cache, v_cache, k, v, rows.data_ptr<int64_t>());
  write_rows<float>(k_cache, v_cache, k, v, rows.data_ptr<int64_t>());
}

}  // namespace

TORCH_LIBRARY_IMPL(lmserve, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_cache", &write_kv_cache);
}

#endif  // not (__AVX512F__ && __F16C__)
