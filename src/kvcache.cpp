// Attention over a KV cache (flash-attn's flash_attn_with_kvcache): validated whole, then the new
// keys and values are appended to the cache (the one place flashdl writes a caller's array, and
// only after every check has passed), then one forward call reads the cache through
// Params.seqused_k (and Params.block_table when it is paged). CUDA arrays: the append and the
// attention are the CUDA backend's (cuda::forward_kvcache), on the device.
#include <cstring>
#include <string>
#include <vector>

#include "backend.hpp"
#include "flashdl/api.hpp"
#include "flashdl/detail/kv_cache.hpp"
#include "validate.hpp"

namespace flashdl {

namespace {

using namespace validate;

struct Cache {
  bool paged = false;
  int64_t capacity = 0;   // keys a sequence can hold
  int64_t page_size = 0;  // paged: rows per page
  int64_t num_pages = 0;  // paged: pages in the cache
  int64_t seqlen_new = 0;
  std::vector<int32_t> used;  // keys per sequence after the append
};

std::string at(const char* name, int64_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

// A host int32 array's element i (any stride).
int64_t read_i32(const TensorView& t, int64_t i, int64_t j = 0) {
  const auto* base = static_cast<const int32_t*>(t.data);
  return base[i * t.strides[0] + (t.rank > 1 ? j * t.strides[1] : 0)];
}

void check_host_int32(const char* name, const TensorView& t, int rank, const char* layout) {
  check_rank(name, t, rank, layout);
  check_dtype(name, t, DType::int32, "indices and lengths are int32");
  if (t.device.type != DeviceType::cpu)
    fail(ErrorKind::value, std::string(name) + ": expected an array on the CPU (host memory), got " +
                               device_name(t.device.type) + ":" + std::to_string(t.device.id));
}

// The layout checks of the cache and the new keys, the lengths and the page table; returns the
// cache's geometry and the per-sequence key counts after the append.
Cache check_cache(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                  const TensorView& cache_seqlens, const TensorView& k_new,
                  const TensorView& v_new, const TensorView& block_table) {
  check_rank("q", q, 4, "(batch, seqlen_q, nheads, headdim)");
  const int64_t batch = q.shape[0];
  Cache c;
  c.paged = block_table.defined();
  const char* clay = c.paged ? "(num_pages, page_size, nheads_kv, headdim) (paged)"
                             : "(batch, seqlen_cache, nheads_kv, headdim)";
  check_rank("k_cache", k_cache, 4, clay);
  check_rank("v_cache", v_cache, 4, clay);
  check_shape("v_cache", v_cache, {k_cache.shape[0], k_cache.shape[1], k_cache.shape[2],
                                   k_cache.shape[3]}, "(the shape of k_cache)");
  if (c.paged) {
    check_host_int32("block_table", block_table, 2, "(batch, max_pages_per_sequence)");
    check_last_dim_contiguous("block_table", block_table);
    if (block_table.shape[0] != batch)
      fail(ErrorKind::value, "block_table: expected " + std::to_string(batch) +
                                 " rows (the batch of q), got shape " + shape_str(block_table));
    c.num_pages = k_cache.shape[0];
    c.page_size = k_cache.shape[1];
    if (c.page_size < 1)
      fail(ErrorKind::value, "k_cache: expected pages of at least one row, got shape " +
                                 shape_str(k_cache));
    c.capacity = block_table.shape[1] * c.page_size;
  } else {
    if (k_cache.shape[0] != batch)
      fail(ErrorKind::value, "k_cache: batch " + std::to_string(k_cache.shape[0]) +
                                 " does not match the batch of q, " + std::to_string(batch) +
                                 " (a paged cache needs block_table)");
    c.capacity = k_cache.shape[1];
  }

  // What the core's checks would report under the names k and v, named as this call's arguments.
  if (k_cache.shape[3] != q.shape[3])
    fail(ErrorKind::value, "k_cache: headdim " + std::to_string(k_cache.shape[3]) +
                               " does not match the headdim of q, " + std::to_string(q.shape[3]));
  const int64_t hk = k_cache.shape[2];
  if (hk == 0 ? q.shape[2] != 0 : q.shape[2] % hk != 0)
    fail(ErrorKind::value, "k_cache: nheads_kv " + std::to_string(hk) +
                               " must divide nheads of q, " + std::to_string(q.shape[2]));
  check_dtype("k_cache", k_cache, q.dtype, "the dtype of q");
  check_dtype("v_cache", v_cache, q.dtype, "the dtype of q");
  check_device("k_cache", k_cache, q.device);
  check_device("v_cache", v_cache, q.device);
  check_last_dim_contiguous("k_cache", k_cache);
  check_last_dim_contiguous("v_cache", v_cache);

  if (k_new.defined() != v_new.defined())
    fail(ErrorKind::value, std::string(k_new.defined() ? "v" : "k") +
                               ": expected both k and v (the new keys and values) or neither");
  if (k_new.defined()) {
    const char* nlay = "(batch, seqlen_new, nheads_kv, headdim)";
    check_rank("k", k_new, 4, nlay);
    check_rank("v", v_new, 4, nlay);
    check_shape("k", k_new, {batch, k_new.shape[1], k_cache.shape[2], k_cache.shape[3]},
                "(batch of q, seqlen_new, nheads_kv and headdim of k_cache)");
    check_shape("v", v_new, {batch, k_new.shape[1], k_cache.shape[2], k_cache.shape[3]},
                "(the shape of k)");
    check_dtype("k", k_new, k_cache.dtype, "the dtype of k_cache");
    check_dtype("v", v_new, k_cache.dtype, "the dtype of k_cache");
    check_device("k", k_new, q.device);
    check_device("v", v_new, q.device);
    check_last_dim_contiguous("k", k_new);
    check_last_dim_contiguous("v", v_new);
    c.seqlen_new = k_new.shape[1];
  }

  check_host_int32("cache_seqlens", cache_seqlens, 1, "(batch,)");
  check_shape("cache_seqlens", cache_seqlens, {batch}, "(batch,): tokens in each sequence's cache");
  c.used.resize(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = read_i32(cache_seqlens, b);
    if (len < 0)
      fail(ErrorKind::value, "cache_seqlens: expected lengths >= 0, got " +
                                 at("cache_seqlens", b) + " = " + std::to_string(len));
    if (len + c.seqlen_new > c.capacity)
      fail(ErrorKind::value,
           "cache_seqlens: " + at("cache_seqlens", b) + " = " + std::to_string(len) +
               (c.seqlen_new ? " plus " + std::to_string(c.seqlen_new) + " new tokens" : "") +
               " exceeds the cache's capacity of " + std::to_string(c.capacity) +
               (c.paged ? " (the pages of block_table: max_pages_per_sequence x page_size)"
                        : " (seqlen_cache)") +
               "; nothing was written");
    c.used[b] = static_cast<int32_t>(len + c.seqlen_new);
    if (!c.paged) continue;
    for (int64_t page = 0; page * c.page_size < c.used[b]; ++page) {
      const int64_t id = read_i32(block_table, b, page);
      if (id < 0 || id >= c.num_pages)
        fail(ErrorKind::value, "block_table: block_table[" + std::to_string(b) + ", " +
                                   std::to_string(page) + "] = " + std::to_string(id) +
                                   " is not a page of k_cache (0.." +
                                   std::to_string(c.num_pages - 1) + "); nothing was written");
    }
  }
  return c;
}

// The cache seen as the dense (batch, capacity, nheads_kv, headdim) k or v the core's checks and
// make_params expect. A paged cache has no such layout: its stand-in repeats one row (strides 0),
// so that the core's overlap checks see memory the cache really has (the whole cache is checked
// separately), and forward_kvcache then puts the page strides into Params.
TensorView as_dense(const TensorView& cache, int64_t batch, int64_t capacity, bool paged) {
  TensorView r = cache;
  r.shape = {batch, capacity, cache.shape[2], cache.shape[3]};
  if (paged) r.strides[0] = r.strides[1] = 0;
  return r;
}

// Rows [used - seqlen_new, used) of every sequence of the cache = the new keys (or values).
void append_rows(const Params& p, const Cache& c, const TensorView& src, bool values) {
  const auto es = static_cast<int64_t>(dtype_size(src.dtype));
  char* base = static_cast<char*>(const_cast<void*>(values ? p.v_ptr : p.k_ptr));
  const auto* from = static_cast<const char*>(src.data);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t j = 0; j < c.seqlen_new; ++j)
      for (int64_t hk = 0; hk < p.nheads_kv; ++hk) {
        const int64_t pos = c.used[b] - c.seqlen_new + j;
        const int64_t dst = values ? detail::v_cache_offset(p, b, pos, hk)
                                   : detail::k_cache_offset(p, b, pos, hk);
        const int64_t off = b * src.strides[0] + j * src.strides[1] + hk * src.strides[2];
        std::memcpy(base + dst * es, from + off * es, static_cast<size_t>(p.headdim * es));
      }
}

}  // namespace

void forward_kvcache(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                     const TensorView& cache_seqlens, const TensorView& k_new,
                     const TensorView& v_new, const TensorView& block_table,
                     const TensorView& out, const TensorView& lse, const Options& options) {
  const Cache c = check_cache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table);
  const int64_t batch = q.shape[0];
  const TensorView k4 = as_dense(k_cache, batch, c.capacity, c.paged),
                   v4 = as_dense(v_cache, batch, c.capacity, c.paged);
  const Shapes s = check_attention_args(q, k4, v4, out, lse, options);
  check_score_mods(options, s, q.device, {{"out", &out}, {"lse", &lse}});
  refuse_extras(options, "KV-cache (forward_kvcache)");
  if (options.dropout_p != 0.0f)
    fail(ErrorKind::value, "dropout_p: attention over a KV cache is for inference, expected 0, "
                           "got " + num_str(options.dropout_p));
  if (options.block_mask.defined())
    fail(ErrorKind::value, "block_mask: not supported with a KV cache; expected None");
  if (options.num_splits < 0)
    fail(ErrorKind::value, "num_splits: expected >= 0 (0: chosen from the shape), got " +
                               std::to_string(options.num_splits));
  // The caches are written through and read after the new rows: no output may overlap them, nor
  // may the new rows overlap the caches they are copied into.
  for (auto [name, t] : {NamedView{"k_cache", &k_cache}, {"v_cache", &v_cache},
                         {"k", &k_new}, {"v", &v_new}}) {
    if (!t->defined()) continue;
    check_no_overlap("out", out, name, *t);
    check_no_overlap("lse", lse, name, *t);
  }
  if (k_new.defined()) {
    for (auto [name, t] : {NamedView{"k", &k_new}, {"v", &v_new}, {"q", &q}}) {
      check_no_overlap("k_cache", k_cache, name, *t);
      check_no_overlap("v_cache", v_cache, name, *t);
    }
    check_no_overlap("v_cache", v_cache, "k_cache", k_cache);
    check_no_self_overlap("k_cache", k_cache);
    check_no_self_overlap("v_cache", v_cache);
  }

  Params p = make_params(q, k4, v4, out, lse, options, s);
  p.seqused_k = c.used.data();
  if (c.paged) {
    p.k_batch_stride = k_cache.strides[0];
    p.k_row_stride = k_cache.strides[1];
    p.v_batch_stride = v_cache.strides[0];
    p.v_row_stride = v_cache.strides[1];
    p.block_table = static_cast<const int32_t*>(block_table.data);
    p.block_table_batch_stride = block_table.strides[0];
    p.page_size = c.page_size;
  }
  p.num_splits = options.num_splits;
  if (q.device.type != DeviceType::cpu) {
    // On the device of q, on the call's stream: the CUDA backend plans (and may still refuse)
    // first, then copies seqused_k and the page table over, appends and attends. The host loop
    // below must not touch device memory.
    if (s.batch == 0) return;
    KvAppend a;
    if (k_new.defined()) {
      a.k_ptr = k_new.data;
      a.v_ptr = v_new.data;
      a.seqlen_new = c.seqlen_new;
      a.k_batch_stride = k_new.strides[0];
      a.k_row_stride = k_new.strides[1];
      a.k_head_stride = k_new.strides[2];
      a.v_batch_stride = v_new.strides[0];
      a.v_row_stride = v_new.strides[1];
      a.v_head_stride = v_new.strides[2];
    }
    cuda::forward_kvcache(p, a);
    return;
  }
  // Every check has passed: now the cache may be written.
  if (k_new.defined()) {
    append_rows(p, c, k_new, false);
    append_rows(p, c, v_new, true);
  }
  if (s.batch == 0 || s.seqlen_q == 0 || s.nheads == 0) return;
  dispatch_forward(p);
}

}  // namespace flashdl
