// Causal attention that reads K/V from the paged block cache in place, for CPU and float32.
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
// The cache is laid out [block, kv head, key, dim]: one kv head's part of a block is a single contiguous run of
// block_size x head_dim values, which the next block's prefetch can fetch line by line while this block computes.
// Token-major blocks ([block, key, kv head, dim]) made every head read strided slices; with them the attention of 16
// decodes ran 1.4x slower (benchmarks/kv_layout.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 16;  // queries per work item: keeps the tile's accumulators in L1/L2

// Eight floats in one AVX register; aligned(4) lets a pointer cast load from any float address.
typedef float Vec8 __attribute__((vector_size(32), aligned(4)));

inline Vec8 load(const float* p) { return *reinterpret_cast<const Vec8*>(p); }
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
template <int kDim, int kRows, typename KV>
void run_block(const float* queries, float* acc, float* s, float* row_max, float* row_sum, int64_t n,
               const KV* k_block, const KV* v_block, const KV* next_k, const KV* next_v, int64_t block_size) {
  constexpr int kVecs = kDim / 8;
  auto prefetch_key = [&](int64_t j) {
    for (int f = 0; f < kDim; f += 64 / static_cast<int>(sizeof(KV))) {  // one 64-byte line at a time
      __builtin_prefetch(next_k + j * kDim + f, 0, 3);
      __builtin_prefetch(next_v + j * kDim + f, 0, 3);
    }
  };
  float block_max[kRows];
  for (int r = 0; r < kRows; ++r) block_max[r] = std::numeric_limits<float>::lowest();
  for (int64_t j = 0; j < n; ++j) {
    const KV* k = k_block + j * kDim;
    if (next_k != nullptr) prefetch_key(j);
    Vec8 dot[kRows] = {};
    for (int v = 0; v < kVecs; ++v) {
      const Vec8 kv = load_kv(k + 8 * v);
      for (int r = 0; r < kRows; ++r) dot[r] += load(queries + r * kDim + 8 * v) * kv;
    }
    for (int r = 0; r < kRows; ++r) {
      s[r * block_size + j] = horizontal_sum(dot[r]);
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
    for (int64_t j = 0; j < n; ++j) {
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
    for (int64_t j = 0; j < n; ++j) {
      const KV* vrow = v_block + j * kDim + 8 * v0;
      for (int v = 0; v < kSlice; ++v) {
        const Vec8 vv = load_kv(vrow + 8 * v);
        for (int r = 0; r < kRows; ++r) a[r][v] += s[r * block_size + j] * vv;
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
                float* row_max, float* row_sum, const int64_t* visible, const int64_t* kv_offset, const KV* k_block,
                const KV* v_block, const KV* next_k, const KV* next_v, int64_t block_size) {
  for (int64_t i = 0; i < rows;) {
    const int64_t in_group = i % group;
    const int64_t count = std::min<int64_t>(4, group - in_group);
    const int64_t n = visible[i];
    if (n > 0) {
      const KV *k = k_block + kv_offset[i], *v = v_block + kv_offset[i];
      const bool prefetches = next_k != nullptr && i < heads && in_group == 0;
      const KV* nk = prefetches ? next_k + kv_offset[i] : nullptr;
      const KV* nv = prefetches ? next_v + kv_offset[i] : nullptr;
      float *q = const_cast<float*>(queries) + i * kDim, *a = acc + i * kDim, *s = scores + i * block_size;
      switch (count) {
        case 1: run_block<kDim, 1, KV>(q, a, s, row_max + i, row_sum + i, n, k, v, nk, nv, block_size); break;
        case 2: run_block<kDim, 2, KV>(q, a, s, row_max + i, row_sum + i, n, k, v, nk, nv, block_size); break;
        case 3: run_block<kDim, 3, KV>(q, a, s, row_max + i, row_sum + i, n, k, v, nk, nv, block_size); break;
        default: run_block<kDim, 4, KV>(q, a, s, row_max + i, row_sum + i, n, k, v, nk, nv, block_size); break;
      }
    }
    i += count;
  }
}

struct WorkItem {
  int64_t request;
  int64_t first_head;  // query heads [first_head, first_head + num_heads)
  int64_t num_heads;
  int64_t first_query;  // within the request
  int64_t num_queries;
};

template <int kDim, typename KV>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& requests, const std::vector<WorkItem>& items,
         int64_t group, double scale) {
  const int64_t block_size = k_cache.size(2), num_kv_heads = k_cache.size(1), max_blocks = block_tables.size(1);
  const int64_t* req = requests.data_ptr<int64_t>();
  const float* q_data = q.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const KV* k_data = k_cache.data_ptr<KV>();
  const KV* v_data = v_cache.data_ptr<KV>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const int64_t block_stride = num_kv_heads * block_size * kDim;
  const float fscale = static_cast<float>(scale);

  // Each thread takes a contiguous run of items of about equal cost (queries x keys x heads), so that one long chunk
  // next to short decodes does not leave a thread idle while the other computes the chunk.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  std::vector<int64_t> bounds(threads + 1, static_cast<int64_t>(items.size()));
  {
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
  }
  at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t last_thread) {
    const int64_t begin = bounds[first_thread], end = bounds[last_thread];
    const int64_t max_rows = kQueryTile * q.size(1);
    std::vector<float> queries(max_rows * kDim), acc(max_rows * kDim), scores(max_rows * block_size);
    std::vector<float> row_max(max_rows), row_sum(max_rows);
    std::vector<int64_t> row_position(max_rows), row_head(max_rows), kv_offset(max_rows), visible(max_rows);
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
      for (int64_t b = 0; b * block_size < keys_needed; ++b) {
        const int64_t block_first = b * block_size;
        const int64_t block_keys = std::min(block_size, keys_needed - block_first);
        // Keys past a query's own position are masked out (causal); key 0 is always visible.
        for (int64_t i = 0; i < rows; ++i) visible[i] = std::min(block_keys, row_position[i] - block_first + 1);
        const bool has_next = block_first + block_size < keys_needed;
        const KV* next_k = has_next ? k_data + table[b + 1] * block_stride : nullptr;
        const KV* next_v = has_next ? v_data + table[b + 1] * block_stride : nullptr;
        tile_block<kDim, KV>(rows, it.num_heads, group, queries.data(), acc.data(), scores.data(), row_max.data(),
                             row_sum.data(), visible.data(), kv_offset.data(), k_data + table[b] * block_stride,
                             v_data + table[b] * block_stride, next_k, next_v, block_size);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t query = it.first_query + i / it.num_heads;
        float* dst = out_data + (first_row + query) * o_row + row_head[i] * o_head;
        const float inv = 1.f / row_sum[i];
        for (int64_t d = 0; d < kDim; ++d) dst[d] = acc[i * kDim + d] * inv;
      }
    }
  });
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& requests,
                     double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "paged_attention: float32 queries");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf),
              "paged_attention: float32 or float16 caches");
#if !defined(__F16C__)
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat, "paged_attention: a float16 cache needs a CPU with F16C");
#endif
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_attention: shapes");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_attention: head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32");
  TORCH_CHECK(requests.scalar_type() == at::kLong && requests.is_contiguous() && requests.size(1) == 3,
              "requests: int64 [R, 3] of (first row, query length, context length)");

  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(2), num_kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: caches must be [blocks, kv heads, block size, head dim] with head dim ", head_dim,
              " and a kv head count that divides ", num_heads, " query heads");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_requests = requests.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(block_tables.size(0) == num_requests, "block_tables: one row per request");

  const int64_t* req = requests.data_ptr<int64_t>();
  int64_t tiles = 0;
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t query_len = req[3 * r + 1], context_len = req[3 * r + 2];
    TORCH_CHECK(query_len >= 1 && context_len >= query_len && context_len <= max_blocks * block_size,
                "paged_attention: request ", r, " has query length ", query_len, " and context ", context_len);
    tiles += (query_len + kQueryTile - 1) / kQueryTile;
  }
  // With enough tiles to keep every thread busy, one work item takes all heads: it then reads each cache block
  // once. With fewer (a single stream), items split by kv head so that all threads work. So does
  // a request that alone costs more than a thread's share (a prefill chunk over a long context among decodes), with
  // half tiles of queries, so that its pieces spread evenly over the threads.
  const int64_t threads = at::get_num_threads();
  int64_t total_cost = 0;
  for (int64_t r = 0; r < num_requests; ++r) total_cost += req[3 * r + 1] * req[3 * r + 2];
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

#if defined(__F16C__)
  if (k_cache.scalar_type() == at::kHalf) {
    switch (head_dim) {
      case 8: return run<8, at::Half>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale);
      case 16: return run<16, at::Half>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale);
      case 32: return run<32, at::Half>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale);
      case 64: return run<64, at::Half>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale);
      case 128: return run<128, at::Half>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale);
      case 256: return run<256, at::Half>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale);
      default: TORCH_CHECK(false, "paged_attention: head_dim ", head_dim, " is not one of 8, 16, 32, 64, 128, 256");
    }
  }
#endif
  switch (head_dim) {
    case 8: return run<8, float>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale);
    case 16: return run<16, float>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale);
    case 32: return run<32, float>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale);
    case 64: return run<64, float>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale);
    case 128: return run<128, float>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale);
    case 256: return run<256, float>(out, q, k_cache, v_cache, block_tables, requests, items, group, scale);
    default: TORCH_CHECK(false, "paged_attention: head_dim ", head_dim, " is not one of 8, 16, 32, 64, 128, 256");
  }
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

// The step's new K and V into the cache: token t's kv head h goes to row rows[t * heads + h] of the cache viewed as
// [blocks * kv heads * block size, head dim] (AttentionMetadata.cache_rows), converted to the cache's type. One op
// per layer where PyTorch took two conversions and two index_copy_ calls.
void write_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& rows) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "write_kv_cache: float32 K and V");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "write_kv_cache: K and V must be [tokens, kv heads, head dim] with contiguous rows");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf),
              "write_kv_cache: float32 or float16 caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 4 && k_cache.size(1) == k.size(1) && k_cache.size(3) == k.size(2),
              "write_kv_cache: caches must be [blocks, kv heads, block size, head dim] matching K and V");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == k.size(0) * k.size(1),
              "write_kv_cache: one int64 row per token and kv head");
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t cache_rows = k_cache.numel() / k_cache.size(3);
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < cache_rows, "write_kv_cache: row ", row[i], " is outside the cache");
  if (k_cache.scalar_type() == at::kHalf) return write_rows<at::Half>(k_cache, v_cache, k, v, row);
  write_rows<float>(k_cache, v_cache, k, v, row);
}

}  // namespace

TORCH_LIBRARY(lmserve, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor requests, float scale) -> ()");
  m.def("write_kv_cache(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(lmserve, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_cache", &write_kv_cache);
}
