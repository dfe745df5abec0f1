// What the two paged attention kernels share: argument checks, the split of the work into items and of the items
// over threads, and the write of new rows. Which kernel a build holds depends on its target (kKeysTransposed):
// - paged_attention.cpp, where the compiler targets AVX-512: K blocks transposed, [block, kv head, dim, key], so that
//   a query's scores against 16 keys are one chain of multiply-adds;
// - paged_attention_avx2.cpp everywhere else: K blocks like V's, [block, kv head, key, dim], one dot product per key.
//   On AVX2 (8 lanes, 16 registers) the transposed kernel ran at 0.76-0.94x of this one (benchmarks/kv_layout.py).
// The Python side asks `torch.ops.lmserve.paged_keys_transposed()` which layout to allocate.
//
// An int8 cache (`--kv-cache-dtype int8`, worker/kv_int8.py) stores K like V in both kernels, [block, kv head, key,
// row], each row a key's head_dim int8 values followed by a float16 scale per int8_group(head_dim) values (llama.cpp's
// q8_0 block: 34 bytes per 32 values). A kernel dequantizes each block it reads, the kv heads a work item needs,
// into a float32 tile of its thread's (a few KB, in L1/L2) and runs its float32 path over that tile: the cache is
// read once, at 0.53x a float16 cache's bytes, and the arithmetic after the tile is the float32 cache's.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace lmserve_paged {

#if defined(__AVX512F__) && defined(__F16C__)
constexpr bool kKeysTransposed = true;
#else
constexpr bool kKeysTransposed = false;
#endif

constexpr int64_t kQueryTile = 16;  // queries per work item: keeps the tile's accumulators in L1/L2

// An int8 cache row (lmserve.kv_sizing.kv_row_bytes): head_dim values, then a float16 scale per group.
constexpr int64_t kInt8Group = 32;
inline int64_t int8_group(int64_t dim) { return dim % kInt8Group == 0 ? kInt8Group : dim; }
inline int64_t int8_row_bytes(int64_t dim) { return dim + 2 * (dim / int8_group(dim)); }
// The elements of one cache row of a kv head's key or value: head_dim, or an int8 row's bytes.
inline int64_t cache_row_width(at::ScalarType type, int64_t dim) {
  return type == at::kChar ? int8_row_bytes(dim) : dim;
}

// x rounded to an int8 row: per group, scale = max |x| / 127 rounded to float16, q = round(x / scale) (ties to even)
// within +-127, the scales after the values (memcpy: a row starts at any even byte). worker/kv_int8.py's quantize_kv
// computes the same bits.
inline void quantize_row(int8_t* dst, const float* src, int64_t dim) {
  const int64_t group = int8_group(dim);
  for (int64_t g = 0; g * group < dim; ++g) {
    const float* x = src + g * group;
    float amax = 0.f;
    for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::abs(x[i]));
    const at::Half scale(std::min(amax * (1.f / 127.f), 65504.f));
    const float wide = static_cast<float>(scale);
    const float inverse = wide > 0.f ? 1.f / wide : 0.f;
    for (int64_t i = 0; i < group; ++i)
      dst[g * group + i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] * inverse), -127.f, 127.f));
    std::memcpy(dst + dim + 2 * g, &scale, 2);
  }
}

// An int8 row back to floats: q x scale, exact in float32 (8 bits times float16's 11).
inline void dequantize_row(const int8_t* src, float* dst, int64_t dim) {
  const int64_t group = int8_group(dim);
  for (int64_t g = 0; g * group < dim; ++g) {
    at::Half scale;
    std::memcpy(&scale, src + dim + 2 * g, 2);
    const float s = static_cast<float>(scale);
    const int8_t* q = src + g * group;
    float* y = dst + g * group;
    for (int64_t i = 0; i < group; ++i) y[i] = static_cast<float>(q[i]) * s;
  }
}

// A step's new K and V into an int8 cache: the same row layout for K and V, in every build (the header's top).
inline void write_int8_rows(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                            const at::Tensor& v, const int64_t* rows) {
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2), width = int8_row_bytes(dim);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && v_cache.size(3) == width,
              "write_kv_cache: int8 caches must both be [blocks, kv heads, block size, ", width, "] for head dim ",
              dim);
  int8_t* k_dst = k_cache.data_ptr<int8_t>();
  int8_t* v_dst = v_cache.data_ptr<int8_t>();
  const float* k_src = k.data_ptr<float>();
  const float* v_src = v.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 4096 / (heads * dim));  // wake the other threads for prefill only
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t row = rows[t * heads + h];
        quantize_row(k_dst + row * width, k_src + t * k.stride(0) + h * k.stride(1), dim);
        quantize_row(v_dst + row * width, v_src + t * v.stride(0) + h * v.stride(1), dim);
      }
  });
}

struct WorkItem {
  int64_t request;
  int64_t first_head;  // query heads [first_head, first_head + num_heads)
  int64_t num_heads;
  int64_t first_query;  // within the request
  int64_t num_queries;
};

// The checks that do not depend on K's layout (each kernel checks its caches' shapes itself).
inline void check_attention_inputs(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& requests, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, "paged_attention: window must be 0 (none) or a number of positions");
  TORCH_CHECK(softcap >= 0, "paged_attention: softcap must be 0 (none) or positive");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "paged_attention: float32 queries");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf ||
                   k_cache.scalar_type() == at::kChar),
              "paged_attention: float32, float16 or int8 caches");
#if !defined(__F16C__)
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat, "paged_attention: a float16 cache needs a CPU with F16C");
#endif
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_attention: shapes");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_attention: head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32");
  TORCH_CHECK(requests.scalar_type() == at::kLong && requests.is_contiguous() && requests.size(1) == 3,
              "requests: int64 [R, 3] of (first row, query length, context length)");
  TORCH_CHECK(block_tables.size(0) == requests.size(0), "block_tables: one row per request");
}

// gpt-oss's attention sinks: float32 [heads], one logit per query head that joins its softmax and takes no value;
// null where the op was given none.
inline const float* sink_logits(const std::optional<at::Tensor>& sinks, int64_t num_heads) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                  sinks->size(0) == num_heads,
              "paged_attention: sinks must be float32 [", num_heads, "], one logit per query head");
  return sinks->data_ptr<float>();
}

// What a row's accumulated values are multiplied by at the end: 1 / (its softmax's sum), where the sum holds the
// sink's exp(sink - max) too when there is one (in the units of the larger of the sink and the row's max, so that
// neither exp overflows).
inline float output_scale(float row_max, float row_sum, const float* sinks, int64_t head) {
  if (sinks == nullptr) return 1.f / row_sum;
  const float sink = sinks[head];
  if (sink <= row_max) return 1.f / (row_sum + std::exp(sink - row_max));
  const float rescale = std::exp(row_max - sink);
  return rescale / (row_sum * rescale + 1.f);
}

// The first key a query at `position` sees: under a sliding window of `window` positions (0: none) the keys
// position - window + 1 .. position, as transformers' sliding_window_overlay (key > query - window).
inline int64_t first_window_key(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
}

// The work items of a call, after checking each request against its block table.
// With enough tiles to keep every thread busy, one work item takes all heads: it then reads each cache block once.
// With fewer (a single stream), items split by kv head so that all threads work. So does a request that alone costs
// more than a thread's share (a prefill chunk over a long context among decodes), with half tiles of queries, so that
// its pieces spread evenly over the threads.
inline std::vector<WorkItem> plan_work(const at::Tensor& requests, int64_t num_heads, int64_t group,
                                       int64_t block_size, int64_t max_blocks) {
  const int64_t* req = requests.data_ptr<int64_t>();
  const int64_t num_requests = requests.size(0);
  int64_t tiles = 0, total_cost = 0;
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t query_len = req[3 * r + 1], context_len = req[3 * r + 2];
    TORCH_CHECK(query_len >= 1 && context_len >= query_len && context_len <= max_blocks * block_size,
                "paged_attention: request ", r, " has query length ", query_len, " and context ", context_len);
    tiles += (query_len + kQueryTile - 1) / kQueryTile;
    total_cost += query_len * context_len;
  }
  const int64_t threads = at::get_num_threads();
  std::vector<WorkItem> items;
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t query_len = req[3 * r + 1];
    const bool dominant = threads > 1 && query_len > 1 && query_len * req[3 * r + 2] * threads > total_cost;
    const int64_t heads_per_item = tiles >= 2 * threads && !dominant ? num_heads : group;
    const int64_t query_tile = dominant ? kQueryTile / 2 : kQueryTile;
    for (int64_t head = 0; head < num_heads; head += heads_per_item)
      for (int64_t first = 0; first < query_len; first += query_tile)
        items.push_back({r, head, heads_per_item, first, std::min(query_tile, query_len - first)});
  }
  return items;
}

// Thread t takes items [bounds[t], bounds[t + 1]): contiguous runs of about equal cost (queries x keys x heads), so
// that one long chunk next to short decodes does not leave a thread idle while the other computes the chunk.
inline std::vector<int64_t> thread_bounds(const std::vector<WorkItem>& items, const at::Tensor& requests) {
  const int64_t* req = requests.data_ptr<int64_t>();
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  std::vector<int64_t> bounds(threads + 1, static_cast<int64_t>(items.size()));
  auto cost = [&](const WorkItem& it) {
    const int64_t last_key = req[3 * it.request + 2] - req[3 * it.request + 1] + it.first_query + it.num_queries;
    return it.num_queries * last_key * it.num_heads;
  };
  int64_t total = 0, done = 0;
  for (const WorkItem& it : items) total += cost(it);
  bounds[0] = 0;
  int64_t t = 1;
  for (int64_t w = 0; w < static_cast<int64_t>(items.size()) && t < threads; ++w) {
    done += cost(items[w]);
    // Thread t - 1's run ends once the items so far hold t shares of the total.
    while (t < threads && done * threads >= total * t) bounds[t++] = w + 1;
  }
  return bounds;
}

// Calls run.template operator()<kDim, KV>() for the head size and the cache's element type.
template <typename Run>
void dispatch_head_dim(int64_t head_dim, at::ScalarType cache_type, Run&& run) {
  auto by_dim = [&]<typename KV>() {
    switch (head_dim) {
      case 8: return run.template operator()<8, KV>();
      case 16: return run.template operator()<16, KV>();
      case 32: return run.template operator()<32, KV>();
      case 64: return run.template operator()<64, KV>();
      case 128: return run.template operator()<128, KV>();
      case 256: return run.template operator()<256, KV>();
      default: TORCH_CHECK(false, "paged_attention: head_dim ", head_dim, " is not one of 8, 16, 32, 64, 128, 256");
    }
  };
  if (cache_type == at::kChar) return by_dim.template operator()<int8_t>();
#if defined(__F16C__)
  if (cache_type == at::kHalf) return by_dim.template operator()<at::Half>();
#endif
  by_dim.template operator()<float>();
}

// One new position's K (or V) row of one kv head into its cache row, in the cache's element type.
inline void store_row(float* dst, const float* src, int64_t dim) { std::copy(src, src + dim, dst); }
inline void store_row(at::Half* dst, const float* src, int64_t dim) {
  int64_t d = 0;
#if defined(__F16C__)
  for (; d + 8 <= dim; d += 8)  // round to nearest even, as at::Half's conversion does
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; d < dim; ++d) dst[d] = at::Half(src[d]);
}

// The checks of write_kv_cache that do not depend on K's layout, rows inside the cache included.
inline void check_write_inputs(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& rows) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "write_kv_cache: float32 K and V");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "write_kv_cache: K and V must be [tokens, kv heads, head dim] with contiguous rows");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf ||
                   k_cache.scalar_type() == at::kChar),
              "write_kv_cache: float32, float16 or int8 caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && v_cache.dim() == 4 &&
                  v_cache.size(1) == k.size(1) && v_cache.size(3) == cache_row_width(v_cache.scalar_type(), k.size(2)),
              "write_kv_cache: V cache must be [blocks, kv heads, block size, head dim] matching K and V");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == k.size(0) * k.size(1),
              "write_kv_cache: one int64 row per token and kv head");
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t cache_rows = v_cache.numel() / v_cache.size(3);  // rows of V: an int8 row counts once
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < cache_rows, "write_kv_cache: row ", row[i], " is outside the cache");
}

}  // namespace lmserve_paged
